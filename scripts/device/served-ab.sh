#!/usr/bin/env bash
# Phase `served-ab` of scripts/device.sh, one GPU: the served path against the in-process runner (qwen_trt.bench.served,
# this tree), then, if BEFORE names another checkout, that checkout's `qwen-trt serve` under the
# same HTTP load (its own code, this tree's load generator), so one call gives before / after.
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
#       whl/*.whl && export PYTHONPATH=/tmp/site
#   whl/: fastapi, starlette, uvicorn, pydantic, pydantic-core (cp312), annotated-types,
#   typing-inspection and opentelemetry-api (fastapi 0.165 imports it), for Python 3.12
#   BEFORE=before PY=python3 bash scripts/device.sh served-ab    # then read $OUT/served.json
# Environment: MODEL (default WORK/qwen3-4b-shaped, written if missing), CONCURRENCY (1,8,32,64),
#   MAX_BATCH (32), REQUESTS (16; at least 2 x each level), INPUT_WORDS (400), OUTPUT_TOKENS
#   (128), BEFORE (a checkout folder, optional), OUT, WORK, DEADLINE_S (330).
set -uo pipefail
cd "$(dirname "$0")/../.."
DEADLINE_S=${DEADLINE_S:-330}
source scripts/device/common.sh
CONCURRENCY=${CONCURRENCY:-1,8,32,64}
MAX_BATCH=${MAX_BATCH:-32}
REQUESTS=${REQUESTS:-16}
INPUT_WORDS=${INPUT_WORDS:-400}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-128}
SITE=${PYTHONPATH#"$PWD"}
case $PY in /*) ;; */*) PY="$PWD/$PY" ;; esac       # the `before` run starts in another folder

phase_begin model
ensure_model
phase_end $?

phase_begin served
QWEN_TRT_TRACE_HOPS=1 timeout --kill-after=10 "$(bound 200)" "$PY" -m qwen_trt.bench.served \
  --model "$MODEL" --concurrency "$CONCURRENCY" --max-batch "$MAX_BATCH" --requests "$REQUESTS" \
  --input-words "$INPUT_WORDS" --output-tokens "$OUTPUT_TOKENS" --out "$OUT/served.json" \
  >/dev/null 2>"$WORK/served.log"
rc=$?
grep -E '^\[served\]|^\|' "$WORK/served.log" | tee "$OUT/served.log"
phase_end $rc

if [ -n "${BEFORE:-}" ] && [ -d "$BEFORE" ]; then
  phase_begin before
  port=18$((RANDOM % 900 + 100))
  ( cd "$BEFORE" && exec env PYTHONPATH="$PWD$SITE" QWEN_TRT_WORKER=process \
      timeout "$(bound 150)" "$PY" -m qwen_trt.cli serve --model "$MODEL" \
      --max-batch "$MAX_BATCH" --port "$port" --served-model-name bench --log-level warning \
      >"$WORK/before-serve.log" 2>&1 ) &
  spid=$!
  t0=$SECONDS
  "$PY" -m qwen_trt.bench.process "http://127.0.0.1:$port" --pid "$spid" --timeout "$(bound 120)"
  echo "before: healthy after $((SECONDS - t0)) s" | tee -a "$OUT/served.log"
  for c in ${CONCURRENCY//,/ }; do
    n=$(( REQUESTS > 2 * c ? REQUESTS : 2 * c ))
    timeout "$(bound 60)" "$PY" -m qwen_trt.bench.http_bench --url "http://127.0.0.1:$port/v1" \
      --concurrency "$c" --requests "$n" --input-words "$INPUT_WORDS" \
      --output-tokens "$OUTPUT_TOKENS" --warmup 2 --label "before c=$c" \
      --out "$WORK/before-c$c.json" >/dev/null 2>>"$OUT/served.log"
  done
  "$PY" - "$WORK" "$CONCURRENCY" "$OUT/http_before.json" "$((SECONDS - t0))" <<'PY'
import json, sys
work, levels, out = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
rows = []
for c in levels:
    try:
        rows += json.load(open(f"{work}/before-c{c}.json"))["levels"]
    except (OSError, ValueError) as e:
        rows.append({"concurrency": int(c), "error": str(e)})
json.dump({"tool": "qwen_trt.bench.http_bench", "label": "before", "levels": rows},
          open(out, "w"), indent=2)
PY
  kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
  phase_end 0
fi
echo "phases: $(phases_json)"
exit 0
