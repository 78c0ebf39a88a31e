#!/usr/bin/env bash
# Issue 26, one short device call (<= 200 s): the FP8 tensor-core prefill's CUDA test, then
# FP8 batch-1 first token and decode with the prefill dequantizing (QWEN_TRT_FP8_PREFILL=dequant)
# and on tensor cores (tensorcore), each in its own process. Results flat in $OUT.
set -u
OUT=${OUT:-build/out/device}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$SECONDS
timeout 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_quant_cuda.py -k "fp8_tensor_core_prefill or without_tensor_cores_forced" \
  > "$OUT/fp8-prefill-cuda-tests.log" 2>&1
echo "== tests status $? at $((SECONDS - t0)) s"; tail -3 "$OUT/fp8-prefill-cuda-tests.log"
for mode in dequant tensorcore; do
  QWEN_TRT_FP8_PREFILL=$mode timeout 70 "$PY" -m qwen_trt.bench.quant_bench --formats fp8 --no-kernels \
    --no-batched --out "$OUT/fp8-prefill-$mode.json" 2>&1 | tr '\r' '\n' | grep -E '^\[quant-bench\]|Error|error' | tail -4
  echo "== $mode status ${PIPESTATUS[0]} at $((SECONDS - t0)) s"
  "$PY" -c "import json,sys; d=json.load(open(sys.argv[1]))['decode']['fp8']; print('[$mode]', d.get('batch1'), d.get('notes'), d.get('logits_vs_bf16'), d.get('warmup_s'), d.get('error','')[:300])" "$OUT/fp8-prefill-$mode.json" || true
done
