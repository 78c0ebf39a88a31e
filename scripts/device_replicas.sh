#!/usr/bin/env bash
# On a 2-GPU machine: one `qwen-trt serve` replica per GPU behind nginx (deploy/nginx.conf),
# and the aggregate throughput of both against one replica alone, in the same run.
#
#   scripts/device_replicas.sh                  # then read $OUT/replicas.json
#
# The device has no registry and no nginx: carry Debian's nginx package and unpack it here
#   (on the dev machine)  mkdir -p build/debs && (cd build/debs && apt-get download nginx)
#   (carry build/debs; this script runs `dpkg -x` on it)
# Environment:
#   MODEL        checkpoint folder (default: write a random-weight checkpoint with Qwen3-4B's layer
#                shapes via `qwen-trt tiny-model`; its text is noise, lengths are fixed by ignore_eos)
#   NGINX_DEB    the nginx .deb (default build/debs/nginx_*.deb); nginx on PATH works too
#   PY           python with the project installed (default .venv/bin/python, else python3)
#   CONCURRENCY  levels for the bench (default 1,8,32); REQUESTS per level (default 64)
#   INPUT_WORDS / OUTPUT_TOKENS  synthetic prompt words / forced reply tokens (default 400 / 256)
#   SERVE_ARGS   extra `qwen-trt serve` flags; OUT  results folder (default build/out/replicas)
# Results: $OUT/replicas.json (one vs two replicas per concurrency), one.json / two.json (the
# http_bench runs), http_overhead.json (the HTTP layer's cost on GPU 0), gpus.csv, logs.
# Every wait is bounded; servers are stopped by their PIDs on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/out/replicas}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
CONCURRENCY=${CONCURRENCY:-1,8,32}
REQUESTS=${REQUESTS:-64}
INPUT_WORDS=${INPUT_WORDS:-400}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-256}
P1=${P1:-8101}; P2=${P2:-8102}; PN=${PN:-8100}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# -- nginx from the carried .deb -----------------------------------------------------------------
NGINX=$(command -v nginx || true)
if [ -z "$NGINX" ]; then
  DEB=${NGINX_DEB:-$(ls build/debs/nginx_*.deb 2>/dev/null | head -1)}
  [ -n "$DEB" ] && [ -f "$DEB" ] || { echo "no nginx: carry build/debs/nginx_*.deb (see the header)"; exit 1; }
  dpkg -x "$DEB" "$OUT/nginx-root"
  NGINX="$OUT/nginx-root/usr/sbin/nginx"
fi
"$NGINX" -v

# -- the model -----------------------------------------------------------------------------------
if [ -z "${MODEL:-}" ]; then
  MODEL="$OUT/qwen3-4b-shaped"
  [ -f "$MODEL/config.json" ] || "$PY" -m qwen_trt.cli tiny-model "$MODEL" --layers 36 --hidden 2560 \
    --heads 32 --kv-heads 8 --head-dim 128 --intermediate 9728
fi

# -- the HTTP layer's own cost on one GPU (in process vs over loopback, same requests) -----------
CUDA_VISIBLE_DEVICES=0 "$PY" -m qwen_trt.bench.http_overhead --model "$MODEL" --requests 30 \
  --input-words "$INPUT_WORDS" --output-tokens 64 --out "$OUT/http_overhead.json" >/dev/null \
  2>"$OUT/http_overhead.log" || echo "http_overhead failed (see $OUT/http_overhead.log)"

# -- two replicas, one per GPU -------------------------------------------------------------------
start_replica() {  # GPU PORT
  CUDA_VISIBLE_DEVICES=$1 "$PY" -m qwen_trt.cli serve --model "$MODEL" --port "$2" \
    --served-model-name qwen-trt --log-level warning ${SERVE_ARGS:-} >"$OUT/serve-gpu$1.log" 2>&1 &
  PIDS+=($!)
}
wait_health() {  # URL SECONDS
  for _ in $(seq 1 "$2"); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done
  echo "not healthy: $1"; tail -5 "$OUT"/serve-gpu*.log; exit 1
}
start_replica 0 "$P1"
start_replica 1 "$P2"
wait_health "http://127.0.0.1:$P1" 900
wait_health "http://127.0.0.1:$P2" 900

# -- nginx: deploy/nginx.conf with these ports, under its own prefix -----------------------------
NX="$OUT/nginx"
mkdir -p "$NX/logs" "$NX/tmp"
sed -e "s/listen 127.0.0.1:8000;/listen 127.0.0.1:$PN;/" \
    -e "s/server 127.0.0.1:8001 /server 127.0.0.1:$P1 /" -e "s/server 127.0.0.1:8002 /server 127.0.0.1:$P2 /" \
    -e "s/^worker_processes auto;/worker_processes 4;\ndaemon off;/" deploy/nginx.conf >"$NX/nginx.conf"
[ "$(id -u)" = 0 ] && sed -i '1i user root;' "$NX/nginx.conf"
"$NGINX" -p "$NX" -c "$NX/nginx.conf" -e "$NX/logs/error.log" &
PIDS+=($!)
wait_health "http://127.0.0.1:$PN" 30

# -- the same load against one replica, then against both through nginx ---------------------------
bench() {  # URL LABEL FILE
  "$PY" -m qwen_trt.bench.http_bench --url "$1/v1" --concurrency "$CONCURRENCY" \
    --requests "$REQUESTS" --input-words "$INPUT_WORDS" --output-tokens "$OUTPUT_TOKENS" \
    --label "$2" --out "$3" >/dev/null
}
bench "http://127.0.0.1:$P1" "one replica (GPU 0)" "$OUT/one.json"
bench "http://127.0.0.1:$PN" "two replicas behind nginx" "$OUT/two.json"
nvidia-smi --query-gpu=index,name,memory.used --format=csv >"$OUT/gpus.csv" 2>/dev/null || true

"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
one, two = (json.loads((out / f).read_text()) for f in ("one.json", "two.json"))
rows = []
for a, b in zip(one["levels"], two["levels"]):
    rows.append({"concurrency": a["concurrency"],
                 "one_out_tok_s": a["output_token_throughput"], "two_out_tok_s": b["output_token_throughput"],
                 "scale": round(b["output_token_throughput"] / max(a["output_token_throughput"], 1e-9), 2),
                 "one_ttft_ms_p50": a["ttft_ms_p50"], "two_ttft_ms_p50": b["ttft_ms_p50"],
                 "one_itl_ms_p50": a["itl_ms_p50"], "two_itl_ms_p50": b["itl_ms_p50"],
                 "errors": a["errors"] + b["errors"]})
res = {"model": one["model"], "input_words": one["input_words"], "output_tokens": one["output_tokens"],
       "requests_per_level": one["requests_per_level"], "levels": rows}
(out / "replicas.json").write_text(json.dumps(res, indent=2) + "\n")
print(json.dumps(res, indent=2))
PY
