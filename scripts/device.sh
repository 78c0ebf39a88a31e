#!/usr/bin/env bash
# The one device runner: `bash scripts/device.sh PHASE [PHASE ...]` runs each phase (a script in
# scripts/device/, its header lists its knobs) in the order given, each bounded, from the
# repository root. With one phase its results go flat into $OUT (the device machine's, else
# build/out/device) under that phase's own time bound; with several, each phase writes into
# $OUT/PHASE/ and DEADLINE_S (default 560) is the bound of the whole run, shared among the
# phases still to run. The exit status is the first failing phase's.
#
# Phases:
#   ab           batch-1 fast path of an earlier tree (BASE, default .dev-base) and this one,
#                alternated, then the CUDA tests
#   served       CUDA tests, the served path in process and over HTTP with the warm second
#                start (bench.served), constrained decoding (bench.constrained)
#   served-ab    the served path, then BEFORE's `qwen-trt serve` under the same HTTP load
#   starts       `qwen-trt serve` starts (cold, warm, seeded) and the worker restart
#   timeline     the served workload's GPU timeline in process (bench.timeline), constrained
#   worker       the worker process: load time, client against the worker's own speed
#   replicas     (2 GPUs) one replica per GPU behind nginx against one alone; HTTP overhead
#   quant        packed-weight CUDA tests, the FP8/INT4 GEMV sweep, bf16/FP8/INT4 batch 1 and
#                the FP8 prefill modes (bench.quant_bench)
#   qkernel-dot  the tensor-core GEMV against the committed tables, decode with the winners
#   peer         the weight formats beside llama.cpp's Q8_0 / Q4_K_M on the same GPU
#
#   bash scripts/device.sh served                    # one phase, results flat in $OUT
#   DEADLINE_S=580 bash scripts/device.sh ab quant   # two phases, $OUT/ab/ and $OUT/quant/
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=scripts/device

phases() { for f in "$DIR"/*.sh; do [ "$f" = "$DIR/common.sh" ] || basename "$f" .sh; done; }

if [ $# -eq 0 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  [ $# -eq 0 ] && exit 2 || exit 0
fi
for p in "$@"; do
  if [ "$p" = common ] || [ ! -f "$DIR/$p.sh" ]; then
    echo "scripts/device.sh: unknown phase '$p' (phases: $(phases | tr '\n' ' ' | sed 's/ $//'))" >&2
    exit 2
  fi
done

OUT=${OUT:-build/out/device}
if [ $# -eq 1 ]; then
  OUT=$OUT exec bash "$DIR/$1.sh"
fi
TOTAL=${DEADLINE_S:-560}
T0=$SECONDS
n=$#
i=0
rc=0
for p in "$@"; do
  left=$((TOTAL - (SECONDS - T0)))
  share=$((left / (n - i)))
  i=$((i + 1))
  echo "== scripts/device.sh: phase $p ($i of $n), ${share} s of ${left} s left"
  mkdir -p "$OUT/$p"
  OUT="$OUT/$p" DEADLINE_S=$share bash "$DIR/$p.sh"
  status=$?
  echo "== scripts/device.sh: phase $p status $status"
  [ "$rc" -eq 0 ] && rc=$status
done
exit "$rc"
