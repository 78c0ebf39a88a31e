#!/usr/bin/env bash
# Phase `peer` of scripts/device.sh (~8 min): the weight formats and llama.cpp's 8- and 4-bit peers on
# the same GPU in the same call (its UUID in every JSON).
#
#   carry .whl, .dev-tok and .dev-peer: llama.tgz from ../shared/tools/llamacpp-peer/pack.sh
#   beside that folder's make_qwen3_gguf.py
#
# While llama.cpp builds and its GGUFs are written and quantized (CPU only, niced, in the
# background), the GPU runs ours:
#   1. qkernel_sweep --probe: each packed GEMV beside the same loads with one multiply a word
#      (is it bound by its arithmetic or by its memory stream)    -> $OUT/qkernel-probe.json
#   2. quant_bench: bf16 / FP8 / INT4 batch-1 decode, first token, 8- and 32-row decode graphs,
#      resident bytes                                              -> $OUT/quant-bench-peer.json
#   3. qwen-trt bench --concurrency 8,32 per format (the batched runner's aggregate decode)
#                                                                  -> $OUT/serving-<fmt>.json
# then llama.cpp's llama-bench (batch 1) and llama-batched-bench (1/8/32 streams) on Q8_0 and
# Q4_K_M of the same random Qwen3-4B shapes                       -> $OUT/llama-peer.md
# Environment: FORMATS (none,fp8,int4), QUANTS ("Q8_0 Q4_K_M"), SERVING (1), PROBE (1),
#   DEADLINE_S (585).
set -uo pipefail
cd "$(dirname "$0")/../.."
DEADLINE_S=${DEADLINE_S:-585}
source scripts/device/common.sh
use_carried
PEER=${PEER:-$PWD/.dev-peer}
QUANTS=${QUANTS:-Q8_0 Q4_K_M}
FORMATS=${FORMATS:-none,fp8,int4}
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"

# -- llama.cpp: build, GGUF, quantize (CPU), in the background --------------------------------
LC=/tmp/lc
(
  set +e
  mkdir -p $LC && tar -xzf "$PEER/llama.tgz" -C $LC || exit 2
  ( cd $LC && nice -n 19 cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release > "$WORK/lc-cfg.log" 2>&1 \
    && nice -n 19 cmake --build build --target llama-bench llama-batched-bench llama-quantize -j14 \
      > "$WORK/lc-build.log" 2>&1 ) &
  b=$!
  PYTHONPATH=$LC/gguf-py nice -n 19 python3 "$PEER/make_qwen3_gguf.py" \
    $LC/models/ggml-vocab-qwen2.gguf /tmp/q3-4b-f16.gguf > "$WORK/lc-gguf.log" 2>&1
  wait $b || { tail -5 "$WORK/lc-cfg.log" "$WORK/lc-build.log"; exit 3; }
  for q in $QUANTS; do
    nice -n 19 $LC/build/bin/llama-quantize /tmp/q3-4b-f16.gguf "/tmp/q3-4b-$q.gguf" "$q" \
      > "$WORK/lc-quantize-$q.log" 2>&1 || tail -3 "$WORK/lc-quantize-$q.log"
  done
  rm -f /tmp/q3-4b-f16.gguf
  echo ready > "$WORK/lc-ready"
) > "$WORK/lc.log" 2>&1 &
LC_PID=$!

phase_begin model
ensure_model
phase_end $?

if [ "${PROBE:-1}" = 1 ]; then
  phase_begin probe
  timeout --kill-after=10 "$(bound 80)" "$PY" -m qwen_trt.bench.qkernel_sweep --probe --jobs 8 \
    --compile-timeout 40 --out "$OUT/qkernel-probe.json" 2>"$WORK/probe.log"
  rc=$?
  "$PY" - "$OUT/qkernel-probe.json" <<'PY' || true
import json, sys
for k, v in json.load(open(sys.argv[1]))["results"].items():
    print("[probe]", k, v.get("us"), "us", v.get("TBps"), "TB/s", v.get("error", ""))
PY
  phase_end $rc
fi

phase_begin quant-bench
timeout --kill-after=10 "$(bound 150)" "$PY" -m qwen_trt.bench.quant_bench --formats "$FORMATS" \
  --no-kernels --out "$OUT/quant-bench-peer.json" 2>&1 | tr '\r' '\n' \
  | grep -E '^\[quant-bench\]' | tail -12
phase_end ${PIPESTATUS[0]}

if [ "${SERVING:-1}" = 1 ]; then
  for fmt in ${FORMATS//,/ }; do
    phase_begin "serving-$fmt"
    q=(); [ "$fmt" != none ] && q=(--quantization "$fmt")
    timeout --kill-after=10 "$(bound 110)" "$PY" -m qwen_trt bench --model "$MODEL" \
      --concurrency 8,32 --prompt-lens 512 --new-tokens 256 --no-fifo --no-batch1 --turns 2 \
      --long-prompt 512 "${q[@]}" --out "$OUT/serving-$fmt.json" 2>&1 | tr '\r' '\n' \
      | grep -E '^\[bench\]' | tail -8
    phase_end ${PIPESTATUS[0]}
  done
fi

phase_begin llama-wait
while [ ! -f "$WORK/lc-ready" ] && kill -0 $LC_PID 2>/dev/null && [ "$(left)" -gt 60 ]; do sleep 2; done
cat "$WORK/lc.log"
phase_end $([ -f "$WORK/lc-ready" ] && echo 0 || echo 1)

phase_begin llama-bench
{
  echo "# llama.cpp peer, $(cat "$OUT/gpu.txt")"
  for q in $QUANTS; do
    [ -f "/tmp/q3-4b-$q.gguf" ] || continue
    echo "## $q"
    timeout "$(bound 60)" $LC/build/bin/llama-bench -m "/tmp/q3-4b-$q.gguf" -ngl 99 -fa 1 -p 512 \
      -n 256 -d 0,512 -r 3 -o md 2>/dev/null
    timeout "$(bound 60)" $LC/build/bin/llama-batched-bench -m "/tmp/q3-4b-$q.gguf" -ngl 99 -fa on \
      -c 32768 -b 4096 -ub 512 -npp 512 -ntg 256 -npl 1,8,32 2>&1 | grep -E '^\|'
  done
} | tee "$OUT/llama-peer.md"
phase_end 0
echo "phases: $(phases_json)"
