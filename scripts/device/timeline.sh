#!/usr/bin/env bash
# Phase `timeline` of scripts/device.sh: the served workload's GPU timeline in process (qwen_trt.bench.timeline), then the constrained
# decoding costs (qwen_trt.bench.constrained) and, with TESTS=1, the batched CUDA tests, on one
# GPU, each phase bounded so the JSON comes back.
#
#   carry .whl (xgrammar + deps) and .dev-tok (Qwen's real tokenizer: python -m
#   qwen_trt.bench.qwen_vocab GGUF .dev-tok); results in $OUT/timeline.json, constrained.json
# Environment: MODEL, CONCURRENCY (32), REQUESTS (96), INPUT_WORDS (400), OUTPUT_TOKENS (256),
#   PROFILE_STEPS (200), CONSTRAINED (1), TESTS (0), DEADLINE_S (540).
set -uo pipefail
cd "$(dirname "$0")/../.."
DEADLINE_S=${DEADLINE_S:-540}
source scripts/device/common.sh
use_carried

phase_begin model
ensure_model
phase_end $?

phase_begin timeline
timeout --kill-after=10 "$(bound 260)" "$PY" -m qwen_trt.bench.timeline --model "$MODEL" \
  --concurrency "${CONCURRENCY:-32}" --requests "${REQUESTS:-96}" \
  --input-words "${INPUT_WORDS:-400}" --output-tokens "${OUTPUT_TOKENS:-256}" \
  --profile-steps "${PROFILE_STEPS:-200}" --batch1 --out "$OUT/timeline.json" \
  >/dev/null 2>"$WORK/timeline.log"
rc=$?
grep -E '^\[timeline\]|Error|error' "$WORK/timeline.log" | grep -v USDT | tail -20 | tee "$OUT/timeline.log"
phase_end $rc

if [ "${CONSTRAINED:-1}" = 1 ]; then
  phase_begin constrained
  timeout --kill-after=10 "$(bound 150)" "$PY" -m qwen_trt.bench.constrained --model "$MODEL" \
    --out "$OUT/constrained.json" >/dev/null 2>"$WORK/constrained.log"
  rc=$?
  tail -5 "$WORK/constrained.log" | tee "$OUT/constrained.log"
  phase_end $rc
fi

if [ "${TESTS:-0}" = 1 ]; then
  phase_begin cuda-tests
  timeout --kill-after=10 "$(bound 240)" "$PY" -m pytest -q -x -p no:cacheprovider -m cuda \
    ${TEST_FILES:-tests/test_batched_cuda.py} 2>&1 | tail -15 | tee "$OUT/cuda-tests.log"
  phase_end "${PIPESTATUS[0]}"
fi
echo "phases: $(phases_json)"
