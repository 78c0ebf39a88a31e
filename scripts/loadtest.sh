#!/usr/bin/env bash
# aiperf (NVIDIA's load tester) against `qwen-trt serve`, offline, on this machine.
#   scripts/loadtest.sh MODEL_DIR [PORT]      (make loadtest: the tiny model on CPU)
# Starts the server on 127.0.0.1:PORT, runs aiperf with the model's own tokenizer
# (HF_HUB_OFFLINE=1), stops the server by its PID, prints the summary. Knobs (environment):
#   AIPERF (binary), CONCURRENCY (default 1,4), REQUESTS (default 16 per level),
#   ISL / OSL (synthetic input / output tokens, default 128 / 64), OUT (artifact folder),
#   SERVE (the qwen-trt binary), SERVE_ARGS (extra serve flags, e.g. --device cuda),
#   TURNS (> 1: aiperf's multi-turn mode, conversations of TURNS turns whose history grows, the
#   workload that exercises prefix reuse; then REQUESTS counts conversations).
set -euo pipefail
MODEL=${1:?usage: scripts/loadtest.sh MODEL_DIR [PORT]}
PORT=${2:-8765}
AIPERF=${AIPERF:-.venv-aiperf/bin/aiperf}
SERVE=${SERVE:-.venv/bin/qwen-trt}
CONCURRENCY=${CONCURRENCY:-1,4}
REQUESTS=${REQUESTS:-16}
ISL=${ISL:-128}
OSL=${OSL:-64}
OUT=${OUT:-build/out/aiperf}
NAME=${NAME:-qwen-trt}
TURNS=${TURNS:-1}
COUNT_ARGS=(--request-count "$REQUESTS")
if [ "$TURNS" -gt 1 ]; then
  COUNT_ARGS=(--conversation-num "$REQUESTS" --conversation-turn-mean "$TURNS"
              --conversation-turn-delay-mean 0)
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

mkdir -p "$OUT"
$SERVE serve --model "$MODEL" --port "$PORT" --served-model-name "$NAME" --log-level warning \
  ${SERVE_ARGS:-} >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do   # bounded: up to 5 minutes for the model to load
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { echo "qwen-trt serve exited:"; tail -5 "$OUT/serve.log"; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "qwen-trt serve not healthy"; exit 1; }

# aiperf 0.13 resolves a tokenizer through the HF cache when offline (a plain folder path is
# refused), so the model's own tokenizer files go into a private cache under a repo-like name.
SNAP="$OUT/hf-cache/models--qwen-trt--tokenizer/snapshots/local"
mkdir -p "$SNAP" "$OUT/hf-cache/models--qwen-trt--tokenizer/refs"
for f in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json \
         vocab.json merges.txt config.json generation_config.json; do
  [ -f "$MODEL/$f" ] && cp "$MODEL/$f" "$SNAP/"
done
printf local >"$OUT/hf-cache/models--qwen-trt--tokenizer/refs/main"

start=$(date +%s)
HF_HUB_CACHE="$OUT/hf-cache" \
"$AIPERF" profile --model "$NAME" --tokenizer qwen-trt/tokenizer --url "127.0.0.1:$PORT" \
  --endpoint-type chat --streaming --concurrency "$CONCURRENCY" "${COUNT_ARGS[@]}" \
  --synthetic-input-tokens-mean "$ISL" --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean "$OSL" --output-tokens-stddev 0 --extra-inputs ignore_eos:true \
  --use-server-token-count --warmup-request-count 2 --random-seed 0 --ui-type none \
  --artifact-dir "$OUT" \
  >"$OUT/aiperf.out" 2>&1 || { echo "aiperf failed:"; tail -20 "$OUT/aiperf.out"; exit 1; }
echo "aiperf took $(( $(date +%s) - start )) s; artifacts in $OUT"
# One JSON line per concurrency level, from aiperf's own exports.
python3 - "$OUT" "$CONCURRENCY" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = []
files = sorted(out.glob("concurrency_*/profile_export_aiperf.json"))
if not files:   # a single level: aiperf writes straight into the artifact folder
    files = [out / "profile_export_aiperf.json"]
for f in files:
    d = json.loads(f.read_text())
    g = lambda k, s="avg": round((d.get(k) or {}).get(s) or 0.0, 2)
    level = f.parent.name.split("_")[1] if f.parent != out else sys.argv[2]
    rows.append({"concurrency": int(level),
                 "requests": int((d.get("request_count") or {}).get("avg") or 0),
                 "ttft_ms_p50": g("time_to_first_token", "p50"),
                 "ttft_ms_p99": g("time_to_first_token", "p99"),
                 "itl_ms_p50": g("inter_token_latency", "p50"),
                 "output_tok_s": g("output_token_throughput"),
                 "output_tok_s_per_user_p50": g("output_token_throughput_per_user", "p50"),
                 "request_throughput": g("request_throughput"),
                 "errors": len(d.get("error_summary") or [])})
(out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
for r in rows:
    print(json.dumps(r))
PY
