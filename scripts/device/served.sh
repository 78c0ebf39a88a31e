#!/usr/bin/env bash
# Phase `served` of scripts/device.sh, for a change of the engine stack: its CUDA tests, then the served path
# (qwen_trt.bench.served: in process and over HTTP, the warm second start), then the constrained
# decoding costs, each phase bounded by one deadline so the JSON comes back (at most 8 files).
#
#   carry .whl (xgrammar, fastapi, uvicorn, starlette, pydantic, ... for Python 3.12) and .dev-tok
#   (python -m qwen_trt.bench.qwen_vocab GGUF .dev-tok); results flat in $OUT
# Environment: MODEL, TESTS, TEST_K (a pytest -k filter), CONCURRENCY (1,32,64), REQUESTS (16), ROUNDS (2),
#   OUTPUT_TOKENS (256), INPUT_WORDS (400), CONSTRAINED (1), SERVED (1), CUDA_TESTS (1), SEED (0: the
#   warm cache's tuned choices written as $OUT/tune-seed.json), STEP_SIZES (0: the
#   prefill step by size, qwen_trt.bench.step_sizes; STEP_PIECES default,triton compares the
#   step's norm/SiLU pieces), DEADLINE_S (560).
set -uo pipefail
cd "$(dirname "$0")/../.."
DEADLINE_S=${DEADLINE_S:-560}
source scripts/device/common.sh
use_carried
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader 2>/dev/null | tee "$WORK/gpu.txt"

phase_begin model
ensure_model
phase_end $?

if [ "${CUDA_TESTS:-1}" = 1 ]; then
cuda_tests_phase "${TESTS:-tests/test_batched_cuda.py tests/test_constrained_cuda.py}" \
  "${TEST_K:-}" "${TESTS_S:-150}" "$WORK/cuda-tests.log"
fi

if [ "${STEP_SIZES:-0}" = 1 ]; then
  phase_begin step-sizes
  timeout --kill-after=10 "$(bound ${STEP_SIZES_S:-120})" "$PY" -m qwen_trt.bench.step_sizes \
    --model "$MODEL" --pieces "${STEP_PIECES:-default}" \
    --out "$OUT/step-sizes.json" >/dev/null 2>"$WORK/step-sizes.log"
  rc=$?
  tail -20 "$WORK/step-sizes.log"
  phase_end $rc
fi

if [ "${SERVED:-1}" = 1 ]; then
phase_begin served
QWEN_TRT_TRACE_HOPS=1 timeout --kill-after=10 "$(bound ${SERVED_S:-280})" "$PY" -m qwen_trt.bench.served \
  --model "$MODEL" --concurrency "${CONCURRENCY:-1,32,64}" --max-batch 32 \
  --requests "${REQUESTS:-16}" --rounds "${ROUNDS:-2}" --input-words "${INPUT_WORDS:-400}" \
  --output-tokens "${OUTPUT_TOKENS:-256}" --second-start --health-timeout 150 \
  --out "$OUT/served.json" >/dev/null 2>"$WORK/served.log"
rc=$?
grep -E '^\[served\]|^\|' "$WORK/served.log" | tail -24
phase_end $rc
fi

if [ "${SEED:-0}" = 1 ]; then   # the served start's tuned choices as a seed (qwen_trt/fast/seeds)
  phase_begin seed
  "$PY" scripts/tune_seed.py "$OUT/tune-seed.json" \
    --source "$(head -1 "$WORK/gpu.txt" | cut -d, -f1), $(date -u +%F), serve --max-batch 32"
  phase_end $?
fi

if [ "${CONSTRAINED:-1}" = 1 ] && [ "$(left)" -gt 60 ]; then
  phase_begin constrained
  timeout --kill-after=10 "$(bound 170)" "$PY" -m qwen_trt.bench.constrained --model "$MODEL" \
    --out "$OUT/constrained.json" >/dev/null 2>"$WORK/constrained.log"
  rc=$?
  grep -E "tok/s|summary" "$WORK/constrained.log" | tail -8
  phase_end $rc
fi
{ cat "$WORK/gpu.txt"; cat "$WORK/cuda-tests.log"; } >"$OUT/cuda-tests.log" 2>/dev/null
echo "phases: $(phases_json)" | tee "$OUT/phases.json"
