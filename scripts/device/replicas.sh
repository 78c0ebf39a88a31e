#!/usr/bin/env bash
# Phase `replicas` of scripts/device.sh, on a 2-GPU machine: one `qwen-trt serve` replica per GPU behind nginx (deploy/nginx.conf),
# and the aggregate throughput of both against one replica alone, in the same run; before that,
# the HTTP layer's own cost on GPU 0 (qwen_trt.bench.http_overhead) while GPU 1 runs
# the `worker` phase (load time, and the client against the worker's own speed).
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   PY=python3 bash scripts/device.sh replicas          # then read $OUT/replicas.json
#
# The device has no registry and no nginx: carry `.whl` (FastAPI, Starlette, uvicorn, pydantic
# and the few of their needs the image lacks) and `build/debs` (Debian bookworm's nginx 1.22 and
# the libraries it links: libpcre2-8, libssl3, libcrypt1, zlib), prepared on the dev machine:
#   mkdir -p build/debs && (cd build/debs && apt-get download nginx libpcre2-8-0 libssl3 \
#       libcrypt1 zlib1g)
# nginx is unpacked under WORK with `dpkg -x` (or Python, without dpkg); the bundled libraries
# are put on nginx's LD_LIBRARY_PATH only if `nginx -v` fails without them.
# Environment:
#   MODEL        checkpoint folder (default: WORK/qwen3-4b-shaped, a random bf16 checkpoint with
#                Qwen3-4B's shapes, vocab and context: qwen_trt.bench.shaped_model; SHAPE=tiny
#                for a CPU dry run)
#   PY           python with the project's needs (default .venv/bin/python, else python3)
#   CONCURRENCY  levels (default 1,8,32); each level sends max(REQUESTS, 2 x level) requests
#                (REQUESTS default 16)
#   INPUT_WORDS / OUTPUT_TOKENS  synthetic prompt words (80 ≈ 530 tokens with the tiny
#                tokenizer) / tokens forced with ignore_eos (default 80 / 256)
#   WORKER_BENCH auto (default: run scripts/device.sh worker on GPU 1 during the HTTP-overhead
#                phase when 2 GPUs are visible) | 1 (always, in parallel) | 0 (never)
#   SERVE_ARGS   extra `qwen-trt serve` flags; NGINX_LIBS=bundled forces the bundled libraries
#   OUT          results, flat (default $OUT, else build/out/device); WORK the rest (default
#                /tmp/qwen-trt-device); DEADLINE_S the whole script's bound (default 470 s)
# Results in OUT (flat, 7 files at most): replicas.json (one vs two replicas per level, phase
# times, nginx and GPUs), one.json / two.json (the http_bench runs), http_overhead.json,
# worker_speed.json + worker_speed.log (device.sh worker), device.log (this script's output,
# with the tails of the server logs when something failed).
# Every wait is bounded; servers are stopped by their PIDs on exit.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEADLINE_S=${DEADLINE_S:-470}
source scripts/device/common.sh
# this script's own results, and the per-level files of an earlier run (never merged by mistake)
rm -f "$OUT"/{device.log,replicas.json,one.json,two.json,http_overhead.json,worker_speed.json,worker_speed.log} \
      "$WORK"/one-c*.json "$WORK"/two-c*.json
exec > >(tee -a "$OUT/device.log") 2>&1

CONCURRENCY=${CONCURRENCY:-1,8,32}
REQUESTS=${REQUESTS:-16}
INPUT_WORDS=${INPUT_WORDS:-80}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-256}
WORKER_BENCH=${WORKER_BENCH:-auto}
P1=${P1:-8101}; P2=${P2:-8102}; PN=${PN:-8100}
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do
    for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$p" 2>/dev/null || true
  done
}
trap cleanup EXIT
NGPU=$(gpu_count)
echo "repo $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $NGPU GPU(s); python: $PY" \
     "($("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1))"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>/dev/null || true

# -- nginx from the carried .debs ------------------------------------------------------------------
phase_begin nginx
NGINX=$(command -v nginx || true)
NGINX_RUN=()
if [ -z "$NGINX" ] || [ "${NGINX_LIBS:-}" = bundled ]; then
  ROOT="$WORK/nginx-root"
  rm -rf "$ROOT"
  mkdir -p "$ROOT"
  DEB=$(ls build/debs/nginx_*.deb 2>/dev/null | head -1)
  if [ -n "$DEB" ]; then
    unpack_deb "$DEB" "$ROOT"
    NGINX="$ROOT/usr/sbin/nginx"
    if [ "${NGINX_LIBS:-}" = bundled ] || ! "$NGINX" -v >/dev/null 2>&1; then
      for d in build/debs/*.deb; do [ "$d" = "$DEB" ] || unpack_deb "$d" "$ROOT/libs"; done
      LIBS="$ROOT/libs/lib/x86_64-linux-gnu:$ROOT/libs/usr/lib/x86_64-linux-gnu"
      NGINX_RUN=(env "LD_LIBRARY_PATH=$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
      echo "nginx: with the bundled libraries ($LIBS)"
    fi
  else
    echo "no nginx: carry build/debs/nginx_*.deb (see the header)"
    NGINX=""
  fi
fi
NGINX_RUN+=("$NGINX")
NGINX_VERSION=$("${NGINX_RUN[@]}" -v 2>&1) || NGINX_VERSION=""
echo "nginx: ${NGINX_VERSION:-not usable} ($NGINX)"
[ -n "$NGINX_VERSION" ]
phase_end $?

# -- the model ---------------------------------------------------------------------------------------
phase_begin model
ensure_model
MODEL_RC=$?
phase_end $MODEL_RC
[ "$MODEL_RC" = 0 ] || { echo "no model: stopping"; exit 1; }
echo "model: $MODEL ($(du -sh "$MODEL" 2>/dev/null | cut -f1))"

# -- GPU 1: the engine process's own figures; GPU 0: the HTTP layer's cost ------------------------
WORKER_PID=""
if [ "$WORKER_BENCH" = 1 ] || { [ "$WORKER_BENCH" = auto ] && [ "$NGPU" -ge 2 ]; }; then
  echo "== [+$(elapsed) s] worker bench on GPU 1, in parallel (log: $WORK/device_worker.log)"
  GPU=1 MODEL="$MODEL" OUT="$OUT" WORK="$WORK" PY="$PY" DEADLINE_S="$(bound 240)" \
    bash scripts/device/worker.sh >"$WORK/device_worker.log" 2>&1 &
  WORKER_PID=$!
  PIDS+=("$WORKER_PID")
elif [ "$WORKER_BENCH" = auto ]; then
  echo "worker bench: skipped ($NGPU GPU(s); run scripts/device.sh worker after this one)"
fi

phase_begin http_overhead
rc=0
CUDA_VISIBLE_DEVICES=0 timeout --kill-after=10 "$(bound 200)" "$PY" -m qwen_trt.bench.http_overhead \
  --model "$MODEL" --requests 30 --input-words "$INPUT_WORDS" --output-tokens 64 \
  --out "$OUT/http_overhead.json" >/dev/null 2>"$WORK/http_overhead.log" || rc=$?
[ $rc = 0 ] || { echo "http_overhead failed:"; tr '\r' '\n' <"$WORK/http_overhead.log" | grep -v '%|' | tail -15; }
phase_end $rc

if [ -n "$WORKER_PID" ]; then
  phase_begin worker_bench_wait
  wait "$WORKER_PID"
  rc=$?
  grep -E '^(\[worker_speed\]|\[qwen-trt engine\] ready|== )' "$WORK/device_worker.log" || tail -20 "$WORK/device_worker.log"
  phase_end $rc
fi

# -- two replicas, one per GPU -----------------------------------------------------------------------
REPLICA_PIDS=()
start_replica() {  # GPU PORT
  # shellcheck disable=SC2086  # SERVE_ARGS: several flags
  CUDA_VISIBLE_DEVICES=$1 "$PY" -m qwen_trt.cli serve --model "$MODEL" --port "$2" \
    --served-model-name qwen-trt --log-level warning ${SERVE_ARGS:-} >"$WORK/serve-gpu$1.log" 2>&1 &
  PIDS+=($!)
  REPLICA_PIDS+=($!)
}
http_ok() {  # URL: 2xx within 5 s (curl, or Python where the image has no curl)
  if command -v curl >/dev/null 2>&1; then
    curl -sf -m 5 "$1" >/dev/null 2>&1
  else
    "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
      "$1" >/dev/null 2>&1
  fi
}
wait_health() {  # URL SECONDS [PID: give up at once if it exits]
  local i
  for i in $(seq 1 "$2"); do
    http_ok "$1/health" && return 0
    if [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null; then
      echo "exited before it was healthy: $1"
      return 1
    fi
    sleep 1
  done
  echo "not healthy after $2 s: $1"
  return 1
}
server_tails() {
  local f
  for f in "$WORK"/serve-gpu*.log "$WORK/nginx/logs/error.log"; do
    [ -f "$f" ] && { echo "--- $f"; tr '\r' '\n' <"$f" | grep -v '%|' | tail -15; }
  done
}

phase_begin replicas_start
start_replica 0 "$P1"
start_replica 1 "$P2"
rc=0
wait_health "http://127.0.0.1:$P1" "$(bound 300)" "${REPLICA_PIDS[0]}" &&
  wait_health "http://127.0.0.1:$P2" "$(bound 120)" "${REPLICA_PIDS[1]}" || rc=1
[ $rc = 0 ] || server_tails
phase_end $rc

# -- nginx: deploy/nginx.conf with these ports, under its own prefix --------------------------------
phase_begin nginx_start
NX="$WORK/nginx"
rm -rf "$NX"
mkdir -p "$NX/logs" "$NX/tmp"
sed -e "s/listen 127.0.0.1:8000;/listen 127.0.0.1:$PN;/" \
    -e "s/server 127.0.0.1:8001 /server 127.0.0.1:$P1 /" -e "s/server 127.0.0.1:8002 /server 127.0.0.1:$P2 /" \
    -e "s/^worker_processes auto;/worker_processes 4;\ndaemon off;/" deploy/nginx.conf >"$NX/nginx.conf"
[ "$(id -u)" = 0 ] && sed -i '1i user root;' "$NX/nginx.conf"
rc=1
if [ -n "$NGINX_VERSION" ]; then
  "${NGINX_RUN[@]}" -p "$NX" -c "$NX/nginx.conf" -e "$NX/logs/error.log" >"$NX/logs/stderr.log" 2>&1 &
  PIDS+=($!)
  rc=0
  wait_health "http://127.0.0.1:$PN" "$(bound 20)" "$!" ||
    { rc=1; server_tails; cat "$NX/logs/stderr.log"; }
fi
phase_end $rc

# -- the same load against one replica, then against both through nginx ---------------------------
bench() {  # URL LABEL NAME: one http_bench run per level (requests scale with the level)
  local c n rc=0
  for c in ${CONCURRENCY//,/ }; do
    n=$(( 2 * c > REQUESTS ? 2 * c : REQUESTS ))
    timeout --kill-after=10 "$(bound 150)" "$PY" -m qwen_trt.bench.http_bench --url "$1/v1" \
      --concurrency "$c" --requests "$n" --input-words "$INPUT_WORDS" \
      --output-tokens "$OUTPUT_TOKENS" --label "$2" --out "$WORK/$3-c$c.json" >/dev/null || rc=$?
  done
  "$PY" - "$WORK" "$3" "$OUT/$3.json" "$CONCURRENCY" <<'PY'
import json, pathlib, sys
work, name, dest, levels = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
runs = [json.loads(p.read_text()) for c in levels.split(",")
        if (p := work / f"{name}-c{c}.json").is_file()]
if runs:
    merged = {k: v for k, v in runs[0].items() if k not in ("levels", "requests_per_level")}
    merged["levels"] = [lv for r in runs for lv in r["levels"]]
    pathlib.Path(dest).write_text(json.dumps(merged, indent=2) + "\n")
PY
  return $rc
}
phase_begin bench_one
bench "http://127.0.0.1:$P1" "one replica (GPU 0)" one
phase_end $?
if [ -n "$NGINX_VERSION" ]; then
  phase_begin bench_two
  bench "http://127.0.0.1:$PN" "two replicas behind nginx" two
  rc=$?
  [ $rc = 0 ] || server_tails
  phase_end $rc
fi

# -- the summary -------------------------------------------------------------------------------------
PHASES_JSON=$(phases_json)
GPUS=$(nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader 2>/dev/null | paste -sd ';' -)
"$PY" - "$OUT" "$PHASES_JSON" "$NGINX_VERSION" "$GPUS" "$(elapsed)" "$MODEL" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
res = {"phases": json.loads(sys.argv[2]), "nginx": sys.argv[3], "gpus": sys.argv[4],
       "elapsed_s": int(sys.argv[5]), "model": sys.argv[6]}
def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.is_file() else None
one, two = load("one.json"), load("two.json")
if one:                      # one replica alone; beside it the two behind nginx, where they ran
    theirs = {lv["concurrency"]: lv for lv in (two or {}).get("levels", [])}
    rows = []
    for a in one["levels"]:
        b = theirs.get(a["concurrency"])
        row = {"concurrency": a["concurrency"], "requests": a["requests"],
               "one_out_tok_s": a["output_token_throughput"], "one_ttft_ms_p50": a["ttft_ms_p50"],
               "one_itl_ms_p50": a["itl_ms_p50"], "prompt_tokens_mean": a["prompt_tokens_mean"],
               "errors": a["errors"]}
        if b:
            row.update({"two_out_tok_s": b["output_token_throughput"],
                        "scale": round(b["output_token_throughput"]
                                       / max(a["output_token_throughput"], 1e-9), 2),
                        "two_ttft_ms_p50": b["ttft_ms_p50"], "two_itl_ms_p50": b["itl_ms_p50"],
                        "errors": a["errors"] + b["errors"]})
        rows.append(row)
    res.update({"input_words": one.get("input_words"), "output_tokens": one.get("output_tokens"),
                "levels": rows})
ws = load("worker_speed.json")
if ws:
    res["worker_speed"] = {"ready_s": ws.get("load", {}).get("ready_s"),
                           "ratios": {str(r["concurrency"]): {k: r.get(k) for k in (
                               "client_over_step_timer", "client_over_in_process")}
                               for r in ws.get("levels", [])}}
ho = load("http_overhead.json")
if ho:
    res["http_ttft_overhead_ms"] = ho.get("http_ttft_overhead_ms")
(out / "replicas.json").write_text(json.dumps(res, indent=2) + "\n")
print(json.dumps(res, indent=2))
PY
echo "== done in $(elapsed) s; results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
