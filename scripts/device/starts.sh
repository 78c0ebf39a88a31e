#!/usr/bin/env bash
# Phase `starts` of scripts/device.sh (<= 570 s): the CUDA tests of the step pieces and the chained
# sampler, the prefill step by size with the compiled and the Triton step pieces, and
# `qwen-trt serve` started on one GPU, each start timed from the command to a 200 from /health:
#   start1  an empty compile cache (cold)              start2  the same cache again (warm)
#   start3  warm, QWEN_TRT_STEP_TRITON=0                start4  an empty cache seeded from the
#           (the step pieces by torch.compile)                  tuned choices start1 measured
#   restart the engine process killed under start4's server; the next request restarts it:
#           seconds from the kill to that request's answer (the warm-cache restart)
#
#   carry .whl and .dev-tok; results flat in $OUT (at most 7 files: gpu.txt, cuda-tests.log,
#   step-sizes.json, quant-bench.json, starts.json, tune-seed.json, serve.log)
# Environment: CUDA_TESTS (1), TEST_K, STEP_SIZES (1), QUANT (0: quant_bench's bf16 / FP8 / INT4
#   batch-1 decode and decode graphs first), STARTS ("start1 start2 start3 start4"), RESTART (1),
#   START_S (140 per start), DEADLINE_S (570).
set -uo pipefail
cd "$(dirname "$0")/../.."
DEADLINE_S=${DEADLINE_S:-570}
source scripts/device/common.sh
use_carried
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
START_S=${START_S:-140}
CACHE="$WORK/compile-cache"
SEEDED="$WORK/compile-cache-seeded"
rm -rf "$CACHE" "$SEEDED"

phase_begin model
ensure_model
phase_end $?

if [ "${CUDA_TESTS:-1}" = 1 ]; then
  cuda_tests_phase "tests/test_batched_cuda.py tests/test_constrained_cuda.py" \
    "${TEST_K:-width or sampled or step_pieces or triton or seen}" "${TESTS_S:-130}" \
    "$OUT/cuda-tests.log"
fi

if [ "${QUANT:-0}" = 1 ]; then
  phase_begin quant-bench
  timeout --kill-after=10 "$(bound 230)" "$PY" -m qwen_trt.bench.quant_bench --formats none,fp8,int4 \
    --no-kernels --out "$OUT/quant-bench.json" 2>&1 | tr '\r' '\n' | grep -E '^\[quant-bench\]'
  phase_end ${PIPESTATUS[0]}
fi

if [ "${STEP_SIZES:-1}" = 1 ]; then
  phase_begin step-sizes
  timeout --kill-after=10 "$(bound ${STEP_SIZES_S:-100})" "$PY" -m qwen_trt.bench.step_sizes \
    --model "$MODEL" --pieces default,triton --out "$OUT/step-sizes.json" >/dev/null \
    2>"$WORK/step-sizes.log"
  rc=$?
  tail -16 "$WORK/step-sizes.log"
  phase_end $rc
fi

# start NAME CACHE_DIR [ENV=VALUE ...]: serve until healthy (KEEP=1: leave it running, its pid
# in SPID and port in PORT), its stage lines into $OUT/serve.log
start() {
  local name=$1 cache=$2; shift 2
  phase_begin "$name"
  PORT=18$((RANDOM % 900 + 100))
  local log="$WORK/serve-$name.log" t0
  t0=$(date +%s.%N)
  env "$@" timeout --kill-after=5 "$(bound "$START_S")" "$PY" -m qwen_trt.cli serve --model "$MODEL" \
    --max-batch 32 --cache-dir "$cache" --port "$PORT" --log-level warning >"$log" 2>&1 &
  SPID=$!
  "$PY" -m qwen_trt.bench.process "http://127.0.0.1:$PORT" --pid "$SPID" \
    --timeout "$(bound "$START_S")" --since "$t0" --out "$WORK/$name.json"
  if [ "${KEEP:-0}" != 1 ]; then stop_server; fi
  tr '\r' '\n' <"$log" | grep -v '%|' \
    | grep -E "qwen-trt engine|compile cache|qwen-trt batched|qwen-trt fast path|Error|error" \
    | tail -25 > "$WORK/serve-$name.lines"
  { echo "== $name $*"; cat "$WORK/serve-$name.lines"; } >> "$OUT/serve.log"
  grep -E "ready in|compile cache" "$WORK/serve-$name.lines" | tail -3
  phase_end 0
}
stop_server() {
  kill -TERM "$SPID" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "$SPID" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$SPID" 2>/dev/null
  wait "$SPID" 2>/dev/null
  for _ in $(seq 1 20); do pgrep -f "qwen_trt.serving.worker import main" >/dev/null || break; sleep 0.5; done
}

STARTS=${STARTS:-start1 start2 start3 start4}
case " $STARTS " in *" start1 "*) start start1 "$CACHE";; esac
case " $STARTS " in *" start2 "*) start start2 "$CACHE";; esac
# start3: the other step pieces, warm (the default is the Triton kernels; this is torch.compile)
case " $STARTS " in *" start3 "*) start start3 "$CACHE" QWEN_TRT_STEP_TRITON=0;; esac

phase_begin seed
"$PY" scripts/tune_seed.py "$(ls -dt "$CACHE"/*/ | head -1)" "$OUT/tune-seed.json" \
  --source "$(head -1 "$OUT/gpu.txt" | cut -d, -f1), $(date -u +%F), serve --max-batch 32"
rc=$?
[ $rc = 0 ] && cp "$OUT/tune-seed.json" qwen_trt/fast/seeds/device-measured.json
phase_end $rc

case " $STARTS " in *" start4 "*) KEEP=1 start start4 "$SEEDED";; *) RESTART=0;; esac
if [ "${RESTART:-1}" = 1 ]; then
phase_begin restart
"$PY" - "http://127.0.0.1:$PORT" "$WORK/restart.json" "$(bound 120)" <<'PY'
import json, subprocess, sys, time, urllib.request
url, out, bound = sys.argv[1], sys.argv[2], float(sys.argv[3])
body = json.dumps({"max_tokens": 4,
                   "messages": [{"role": "user", "content": "hello"}]}).encode()
def ask():
    req = urllib.request.Request(url + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=bound) as r:
        return r.status
res = {"before": ask()}
pids = subprocess.run(["pgrep", "-f", "qwen_trt.serving.worker import main"],
                      capture_output=True, text=True).stdout.split()
t0 = time.monotonic()
for p in pids:
    subprocess.run(["kill", "-KILL", p])
res["killed"] = pids
while time.monotonic() - t0 < bound:
    try:
        res["after"] = ask()
        break
    except Exception as e:  # noqa: BLE001 - 503 while restarting, or the worker gone
        res["last_error"] = str(e)[:200]
        time.sleep(0.2)
res["restart_to_answer_s"] = round(time.monotonic() - t0, 2)
json.dump(res, open(out, "w"))
print("[restart]", res)
PY
phase_end $?
stop_server
tr '\r' '\n' <"$WORK/serve-start4.log" | grep -v '%|' | grep -E "restart|ready in|Error" | tail -8 \
  | tee -a "$OUT/serve.log"
fi

"$PY" - "$WORK" "$OUT/starts.json" "$(phases_json)" <<'PY'
import json, re, sys
work, out, phases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
res = {"tool": "scripts/device.sh starts", "phases": phases, "starts": {}}
for name in ("start1", "start2", "start3", "start4"):
    row = {}
    try:
        row.update(json.load(open(f"{work}/{name}.json")))
    except (OSError, ValueError):
        pass
    try:
        text = open(f"{work}/serve-{name}.lines").read()
    except OSError:
        text = ""
    m = re.findall(r"stages: (.*)\)", text)
    if m:
        row["stages_s"] = {k: float(v) for k, v in re.findall(r"(\w+) ([0-9.]+)", m[0])}
    row["cache_lines"] = [l.strip() for l in text.splitlines() if "compile cache" in l][:4]
    res["starts"][name] = row
try:
    res["restart"] = json.load(open(f"{work}/restart.json"))
except (OSError, ValueError):
    pass
json.dump(res, open(out, "w"), indent=1)
print(json.dumps({k: v.get("healthy_s") for k, v in res["starts"].items()}),
      res.get("restart", {}).get("restart_to_answer_s"))
PY
echo "phases: $(phases_json)"
