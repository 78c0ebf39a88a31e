#!/usr/bin/env bash
# Fuzz `qwen-trt serve` (offline, on this machine) with schemathesis from two specs: its own
# /openapi.json and OpenAI's (tests/openai_schemas/endpoints.json: /chat/completions,
# /completions, /models from openai/openai-openapi). Passes when no request gets a 5xx and every
# reply matches the spec it was made from; on its own document, with every check (--checks all,
# positive and negative cases): what the document calls valid is accepted and what it calls
# invalid is refused.
#   scripts/check_clients.sh MODEL_DIR [PORT]      (make check-clients: the tiny model on CPU)
# Knobs (environment): ST (the schemathesis binary), SERVE (the qwen-trt binary),
#   EXAMPLES (cases per operation, default 40), OUT (logs folder), SERVE_ARGS.
set -euo pipefail
MODEL=${1:?usage: scripts/check_clients.sh MODEL_DIR [PORT]}
PORT=${2:-8766}
ST=${ST:-.venv-clients/bin/schemathesis}
SERVE=${SERVE:-.venv/bin/qwen-trt}
EXAMPLES=${EXAMPLES:-40}
OUT=${OUT:-build/out/check-clients}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

mkdir -p "$OUT"
$SERVE serve --model "$MODEL" --port "$PORT" --served-model-name tiny --max-seq-len 512 \
  --log-level warning ${SERVE_ARGS:-} >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do   # bounded: up to 5 minutes for the model to load
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { echo "qwen-trt serve exited:"; tail -5 "$OUT/serve.log"; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "qwen-trt serve not healthy"; exit 1; }

status=0
# Short replies keep the CPU run bounded; the fuzzer still varies every other field.
run() {  # name, spec, base url, checks, extra args...
  local name=$1 spec=$2 base=$3 checks=$4; shift 4
  echo "== schemathesis: $name"
  "$ST" run "$spec" --url "$base" --max-examples "$EXAMPLES" --checks "$checks" \
    --request-timeout 300 --max-response-time 300 "$@" >"$OUT/$name.log" 2>&1 \
    || { status=1; tail -30 "$OUT/$name.log"; }
  tail -5 "$OUT/$name.log"
}
# (replies run to the 512-token context on CPU: the time limits are generous, not a check)
run own "http://127.0.0.1:$PORT/openapi.json" "http://127.0.0.1:$PORT" all \
  --exclude-path /metrics --exclude-path /health
run openai tests/openai_schemas/endpoints.json "http://127.0.0.1:$PORT/v1" \
  not_a_server_error,response_schema_conformance
grep -c '"POST /v1/' "$OUT/serve.log" >/dev/null 2>&1 || true
if grep -q "Traceback" "$OUT/serve.log"; then
  echo "the server logged a traceback:"; grep -m3 -A5 Traceback "$OUT/serve.log"; status=1
fi
exit $status
