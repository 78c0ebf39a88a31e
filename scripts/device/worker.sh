#!/usr/bin/env bash
# Phase `worker` of scripts/device.sh: two figures of the worker process as `qwen-trt serve`
# starts it (qwen_trt.bench.worker_speed):
#   1. load + warm-up from WorkerClient start to ready, with the worker's stage lines and
#      timings (target < 60 s on an H200 for Qwen3-4B shapes);
#   2. N = 1, 8, 32 concurrent greedy streams (512-token prompts, 256 tokens forced with
#      ignore_eos) through the client, against the worker's own step timer and against the same
#      runner in process (target: client >= 0.95 x engine).
#
#   PY=python3 bash scripts/device.sh worker     # then read $OUT/worker_speed.json
#
# Alone about 2-3 minutes on an H200 (two model loads: the engine process, then in process).
# scripts/device.sh replicas runs this itself on GPU 1 while GPU 0 measures the HTTP layer,
# when two GPUs are visible (WORKER_BENCH=auto).
# Environment:
#   MODEL        checkpoint folder (default: WORK/qwen3-4b-shaped, written if missing;
#                SHAPE=tiny writes a tiny one instead, for a CPU dry run)
#   GPU          the GPU index to use (default 0)
#   WS_CONCURRENCY / PROMPT_LEN / NEW_TOKENS   default 1,8,32 / 512 / 256
#   WS_ARGS      extra qwen_trt.bench.worker_speed flags (e.g. "--no-in-process";
#                "--device cpu --fast on" for a CPU dry run)
#   OUT          results, flat (default $OUT, else build/out/device); WORK (default
#                /tmp/qwen-trt-device) holds the checkpoint and the full log
#   DEADLINE_S   the whole script's bound in seconds (default 240)
# Results: OUT/worker_speed.json, OUT/worker_speed.log (the bench's lines, progress bars out).
set -uo pipefail
cd "$(dirname "$0")/../.."
DEADLINE_S=${DEADLINE_S:-240}
source scripts/device/common.sh
GPU=${GPU:-0}
WS_CONCURRENCY=${WS_CONCURRENCY:-1,8,32}
PROMPT_LEN=${PROMPT_LEN:-512}
NEW_TOKENS=${NEW_TOKENS:-256}

phase_begin model
MODEL_GPU=$GPU ensure_model
phase_end $?

phase_begin worker_speed
rc=0
# shellcheck disable=SC2086  # WS_ARGS: several flags
CUDA_VISIBLE_DEVICES=$GPU timeout --kill-after=10 "$(bound 230)" "$PY" -m qwen_trt.bench.worker_speed \
  --model "$MODEL" --concurrency "$WS_CONCURRENCY" --prompt-len "$PROMPT_LEN" \
  --new-tokens "$NEW_TOKENS" ${WS_ARGS:-} --out "$OUT/worker_speed.json" \
  >/dev/null 2>"$WORK/worker_speed.full.log" || rc=$?
tr '\r' '\n' <"$WORK/worker_speed.full.log" | grep -v '%|' >"$OUT/worker_speed.log"
grep -E '^\[(worker_speed|qwen-trt engine)\]' "$OUT/worker_speed.log" || tail -20 "$OUT/worker_speed.log"
phase_end $rc
echo "phases: $(phases_json)"
exit $rc
