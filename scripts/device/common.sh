# Shared by the phases of scripts/device.sh (sourced, not run).
#
# Paths: results go flat into OUT (on the device machine its $OUT, which sends back at most 8
# files, 2 folders deep); everything big or many-filed (the checkpoint, nginx's root, server
# logs) goes under WORK, outside OUT. Every phase is bounded by `timeout` and by one deadline
# for the whole script (DEADLINE_S), so the summaries are written even when a phase hangs.

OUT=${OUT:-build/out/device}
WORK=${WORK:-/tmp/qwen-trt-device}
MODEL_DEFAULT="$WORK/qwen3-4b-shaped"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       PYTHONUNBUFFERED=1

T_START=$SECONDS
DEADLINE_S=${DEADLINE_S:-470}
PHASES=()                              # "name seconds status" per phase, for the summary

elapsed() { echo $((SECONDS - T_START)); }
left() { echo $((DEADLINE_S - (SECONDS - T_START))); }

# bound WANT: WANT seconds, or what is left before the deadline (at least 5)
bound() {
  local want=$1 l
  l=$(left)
  [ "$l" -lt "$want" ] && want=$l
  [ "$want" -lt 5 ] && want=5
  echo "$want"
}

phase_begin() { PHASE_NAME=$1; PHASE_T=$SECONDS; echo "== [+$(elapsed) s] $1"; }
phase_end() {   # STATUS (0 = ok)
  local dt=$((SECONDS - PHASE_T))
  echo "== [+$(elapsed) s] $PHASE_NAME: ${dt} s, status $1"
  PHASES+=("$PHASE_NAME $dt $1")
}

# The phases as JSON ({"name": {"s": seconds, "status": code}}), for the summary files.
phases_json() {
  local first=1 p n s st
  printf '{'
  for p in "${PHASES[@]}"; do
    read -r n s st <<<"$p"
    [ $first = 1 ] || printf ', '
    first=0
    printf '"%s": {"s": %s, "status": "%s"}' "$n" "$s" "$st"
  done
  printf '}'
}

# A .deb unpacked into a folder: dpkg -x, or (no dpkg) its data.tar.* read by Python.
unpack_deb() {  # DEB DEST
  if [ "${UNPACK_WITH:-dpkg}" = dpkg ] && command -v dpkg >/dev/null 2>&1; then
    dpkg -x "$1" "$2"
  else
    "$PY" - "$1" "$2" <<'PY'
import io, sys, tarfile
deb, dest = sys.argv[1], sys.argv[2]
data = open(deb, "rb").read()
assert data[:8] == b"!<arch>\n", f"{deb}: not a .deb"
i = 8
while i + 60 <= len(data):
    name, size = data[i:i + 16].decode().strip().rstrip("/"), int(data[i + 48:i + 58])
    body = data[i + 60:i + 60 + size]
    if name.startswith("data.tar"):
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:
            kw = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
            tar.extractall(dest, **kw)
        break
    i += 60 + size + (size & 1)
else:
    sys.exit(f"{deb}: no data.tar member")
PY
  fi
}

# The checkpoint: MODEL if given, else a random one with Qwen3-4B's shapes under WORK
# (qwen_trt.bench.shaped_model: bf16, drawn on GPU 0 when there is one; SHAPE=tiny for a CPU
# dry run; TOKENIZER=DIR: Qwen's real tokenizer from a folder `python -m qwen_trt.bench.qwen_vocab`
# wrote, e.g. .dev-tok carried with the tree).
ensure_model() {
  MODEL=${MODEL:-$MODEL_DEFAULT}
  if [ -f "$MODEL/config.json" ] && ls "$MODEL"/*.safetensors >/dev/null 2>&1; then
    return 0
  fi
  # another script may be writing it right now (both default to the same folder)
  local lock="$WORK/.model.lock" i
  if ! mkdir "$lock" 2>/dev/null; then
    for i in $(seq 1 "$(bound 180)"); do
      [ -d "$lock" ] || break
      sleep 1
    done
    [ -f "$MODEL/config.json" ] && return 0
    echo "the checkpoint was not written in time: $MODEL"; return 1
  fi
  rm -rf "$MODEL"
  CUDA_VISIBLE_DEVICES=${MODEL_GPU:-0} timeout "$(bound 180)" \
    "$PY" -m qwen_trt.bench.shaped_model "$MODEL" --shape "${SHAPE:-qwen3-4b}" \
    ${TOKENIZER:+--tokenizer-from "$TOKENIZER"} 2>&1 |
    tr '\r' '\n' | grep -v '%|'
  local rc=${PIPESTATUS[0]}
  rmdir "$lock"
  return "$rc"
}

gpu_count() {
  nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
}

# What a device script needs from the ignored folders carried with the tree: the wheels in .whl
# (installed into /tmp/site, added to PYTHONPATH) and Qwen's real tokenizer in .dev-tok (TOKENIZER
# for ensure_model), where present.
use_carried() {
  if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      >/dev/null 2>&1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
  TOKENIZER=${TOKENIZER:-$( [ -f .dev-tok/tokenizer.json ] && echo "$PWD/.dev-tok" )}
  export TOKENIZER
}

# The CUDA tests phase: pytest -m cuda over FILES (-k K when given), bounded by BOUND seconds,
# the log (progress bars out) in LOG and its summary lines on stdout.
cuda_tests_phase() {  # FILES K BOUND LOG
  local files=$1 k=$2 bound_s=$3 log=$4 rc
  phase_begin cuda-tests
  # shellcheck disable=SC2086 # FILES is a list of paths
  timeout --kill-after=10 "$(bound "$bound_s")" "$PY" -m pytest -q -rfE -p no:cacheprovider -m cuda \
    $files ${k:+-k "$k"} 2>&1 | tr '\r' '\n' | grep -v '%|' >"$log"
  rc=${PIPESTATUS[0]}
  grep -E "passed|failed|Error|assert" "$log" | tail -12
  phase_end "$rc"
}
