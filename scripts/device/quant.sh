#!/usr/bin/env bash
# Phase `quant` of scripts/device.sh (<= 480 s): the packed-kernel and FP8-prefill CUDA tests; the FP8
# GEMV sweep (every candidate, the f16x2 ``half`` form among them) beside the bf16 GEMV; then,
# with the sweep's winners applied, bf16 and FP8 batch 1 (first token and decode) with the FP8
# prefill dequantizing (QWEN_TRT_FP8_PREFILL=dequant), and FP8 again on tensor cores
# (tensorcore), each in its own process; with RUNNER=1 the batched runner's prefill (a 512-token
# prompt arriving while 8 streams decode, and 8 arriving at once: `qwen-trt bench`) with FP8
# dequantizing and on tensor cores. At most 8 files, flat in $OUT.
#   SWEEP=0   skip the sweep (the committed tables)    TESTS=0   skip the CUDA tests
#   FORMATS=none,fp8   the dequant run's formats        BATCHED=1  also the 8/32-row graphs
#   TEST_K="..."       which CUDA tests (pytest -k)       RUNNER=1   the runner's prefill too
#   SWEEP_ONLY=qgemv:fp8,gemv   what the sweep times      SWEEP_OUT=qkernel-sweep-half-h200.json
#   MODES="dequant tensorcore"  the prefill modes run (the first with FORMATS, the rest FP8)
set -u
OUT=${OUT:-build/out/device}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$SECONDS
if [ "${TESTS:-1}" = 1 ]; then
  timeout 170 "$PY" -m pytest -q -p no:cacheprovider tests/test_quant_cuda.py \
    -k "${TEST_K:-packed_kernels_match or fp8_tensor_core_prefill or without_tensor_cores_forced}" \
    > "$OUT/fp8-cuda-tests.log" 2>&1
  echo "== tests status $? at $((SECONDS - t0)) s"; tail -3 "$OUT/fp8-cuda-tests.log"
fi
APPLY=()
if [ "${SWEEP:-1}" = 1 ]; then
  SW="$OUT/${SWEEP_OUT:-qkernel-sweep-half-h200.json}"
  timeout 150 "$PY" -m qwen_trt.bench.qkernel_sweep --only "${SWEEP_ONLY:-qgemv:fp8,gemv}" \
    --jobs 14 --compile-timeout 50 --out "$SW" > "$OUT/sweep.log" 2>&1
  echo "== sweep status $? at $((SECONDS - t0)) s"
  "$PY" -m qwen_trt.bench.qkernel_sweep --out - --print-tables "$SW" 2>&1 | head -12
  APPLY=(--apply-sweep "$SW")
fi
NB=--no-batched
[ "${BATCHED:-0}" = 1 ] && NB=
run() {  # MODE FORMATS
  QWEN_TRT_FP8_PREFILL=$1 timeout 200 "$PY" -m qwen_trt.bench.quant_bench --formats "$2" --no-kernels \
    $NB "${APPLY[@]}" --out "$OUT/quant-bench-$1.json" 2>&1 | tr '\r' '\n' | grep -E '^\[quant-bench\]|Error|error' | tail -6
  echo "== $1 status ${PIPESTATUS[0]} at $((SECONDS - t0)) s"
  "$PY" -c "
import json, sys
for f, d in json.load(open(sys.argv[1]))['decode'].items():
    print('[$1]', f, d.get('batch1'), d.get('notes'), d.get('error', '')[:300])" "$OUT/quant-bench-$1.json" || true
}
first=1
for mode in ${MODES:-dequant tensorcore}; do
  if [ $first = 1 ]; then run "$mode" "${FORMATS:-none,fp8}"; else run "$mode" fp8; fi
  first=0
done
if [ "${RUNNER:-0}" = 1 ]; then
  WORK=${WORK:-/tmp/qwen-trt-device}
  source scripts/device/common.sh
  ensure_model > "$WORK/model.log" 2>&1; echo "== model status $? at $((SECONDS - t0)) s"
  for mode in dequant tensorcore; do
    QWEN_TRT_FP8_PREFILL=$mode timeout 150 "$PY" -m qwen_trt bench --model "$MODEL" \
      --concurrency 8 --prompt-lens 512 --new-tokens 128 --no-fifo --no-batch1 --turns 1 \
      --long-prompt 512 --quantization fp8 --out "$OUT/runner-fp8-$mode.json" 2>&1 \
      | tr '\r' '\n' | grep -E '^\[bench\]|Error' | tail -4
    echo "== runner $mode status ${PIPESTATUS[0]} at $((SECONDS - t0)) s"
    "$PY" -c "
import json, sys
d = json.load(open(sys.argv[1]))
print('[runner $mode] long', d.get('long_prompt'), 'burst', {k: (v.get('ttft_ms_p50'), v.get('aggregate_decode_tok_s')) for k, v in d.get('burst', {}).items()})" "$OUT/runner-fp8-$mode.json" || true
  done
fi
