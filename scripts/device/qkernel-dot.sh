#!/usr/bin/env bash
# Phase `qkernel-dot` of scripts/device.sh (<= 200 s): time the pipelined tensor-core GEMV (QConfig.dot) against
# the committed FP8 / INT4 GEMV tables, then batch-1 decode with the sweep's winners applied,
# then the CUDA tests of the packed kernels. Results flat in $OUT:
#   qkernel-sweep-dot-h200.json  every FP8 / INT4 GEMV candidate (old and new) and the bf16 GEMV
#   quant-bench-dot-h200.json    FP8 and INT4 decode tok/s with the winners (--apply-sweep)
#   qkernel-dot-tables.txt       the winners as qkernels.py's table lines (--print-tables)
#   qkernel-dot-cuda-tests.log   tests/test_quant_cuda.py (the packed-kernel tests)
# Every phase has its own timeout, so a hang in one keeps what the others wrote.
set -u
OUT=${OUT:-build/out/device}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
SW="$OUT/qkernel-sweep-dot-h200.json"
t0=$SECONDS
echo "== sweep"
timeout "${SWEEP_S:-100}" "$PY" -m qwen_trt.bench.qkernel_sweep --only qgemv:fp8,qgemv:int4,gemv --vs-table \
  --jobs "${JOBS:-14}" --compile-timeout "${COMPILE_S:-45}" --copies-mb 300 --out "$SW"
echo "== sweep status $? at $((SECONDS - t0)) s"
if [ -s "$SW" ]; then
  "$PY" -m qwen_trt.bench.qkernel_sweep --out - --print-tables "$SW" > "$OUT/qkernel-dot-tables.txt"
  "$PY" - "$SW" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in sorted(d.get("best", {}).items()):
    print(f"[best] {k}: {v}")
for k, v in d.get("results", {}).items():
    if "dot=True" in k:
        print(f"[dot] {k}: {v}")
PYEOF
  echo "== decode"
  timeout "${BENCH_S:-70}" "$PY" -m qwen_trt.bench.quant_bench --formats fp8,int4 --no-kernels \
    --no-batched --new-tokens 128 --apply-sweep "$SW" --out "$OUT/quant-bench-dot-h200.json"
  echo "== decode status $? at $((SECONDS - t0)) s"
  "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); [print('[decode]', f, r.get('batch1', r)) for f, r in d['decode'].items()]" "$OUT/quant-bench-dot-h200.json" || true
fi
echo "== cuda tests"
timeout "${TESTS_S:-$(( 195 - (SECONDS - t0) > 20 ? 195 - (SECONDS - t0) : 20 ))}" "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_quant_cuda.py -k "packed_kernels or tensor_core" > "$OUT/qkernel-dot-cuda-tests.log" 2>&1
echo "== cuda tests status $? at $((SECONDS - t0)) s"; tail -5 "$OUT/qkernel-dot-cuda-tests.log"
