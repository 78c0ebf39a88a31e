#!/usr/bin/env bash
# `qwen-trt serve` started twice with the same --cache-dir on one GPU: the cold start (an empty
# compile cache) and the warm one (the second start on the same machine), each timed from the
# command to a 200 from /health, with the engine's stage lines. One call, every phase bounded.
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site
#   PY=python3 bash scripts/device_warm_start.sh          # then read $OUT/warm-start.json
# Environment: MODEL (default WORK/qwen3-4b-shaped, written if missing; SHAPE=tiny for a CPU dry
#   run), MAX_BATCH (32), STARTS (2), START_S (bound per start, 130), OUT, WORK, DEADLINE_S (225).
set -uo pipefail
cd "$(dirname "$0")/.."
DEADLINE_S=${DEADLINE_S:-225}
source scripts/device_common.sh
MAX_BATCH=${MAX_BATCH:-32}
STARTS=${STARTS:-2}
START_S=${START_S:-130}
CACHE="$WORK/compile-cache"
rm -rf "$CACHE"

phase_begin model
ensure_model
phase_end $?

for i in $(seq 1 "$STARTS"); do
  phase_begin "start$i"
  port=18$((RANDOM % 900 + 100))
  log="$WORK/serve-$i.log"
  t0=$(date +%s.%N)
  timeout --kill-after=5 "$(bound "$START_S")" "$PY" -m qwen_trt.cli serve --model "$MODEL" \
    --max-batch "$MAX_BATCH" --cache-dir "$CACHE" --port "$port" --log-level warning \
    >"$log" 2>&1 &
  spid=$!
  "$PY" -m qwen_trt.bench.process "http://127.0.0.1:$port" --pid "$spid" \
    --timeout "$(bound "$START_S")" --since "$t0" --out "$OUT/start$i.json"
  kill -TERM "$spid" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "$spid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$spid" 2>/dev/null
  wait "$spid" 2>/dev/null
  # the engine process exits once its parent has gone; the next start must find its GPU memory free
  for _ in $(seq 1 20); do pgrep -f "qwen_trt.serving.worker import main" >/dev/null || break; sleep 0.5; done
  tr '\r' '\n' <"$log" | grep -v '%|' \
    | grep -E "qwen-trt engine|compile cache|qwen-trt batched|qwen-trt fast path|Error|error" \
    | tail -25 | tee "$OUT/serve-$i.log"
  phase_end 0
done

"$PY" - "$OUT" "$STARTS" "$CACHE" "$(phases_json)" <<'PY'
import json, os, re, sys
out, starts, cache, phases = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
res = {"tool": "scripts/device_warm_start.sh", "phases": phases, "starts": []}
for i in range(1, starts + 1):
    row = {}
    try:
        row.update(json.load(open(f"{out}/start{i}.json")))
    except (OSError, ValueError):
        pass
    try:
        text = open(f"{out}/serve-{i}.log").read()
    except OSError:
        text = ""
    m = re.search(r"stages: (.*)\)", text)
    if m:
        row["stages_s"] = {k: float(v) for k, v in re.findall(r"(\w+) ([0-9.]+)", m.group(1))}
    row["cache_lines"] = [l.strip() for l in text.splitlines() if "compile cache" in l]
    res["starts"].append(row)
size = 0
for root, _, files in os.walk(cache):
    size += sum(os.path.getsize(os.path.join(root, f)) for f in files)
res["cache_mb"] = round(size / 2**20, 1)
try:
    import torch
    res["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
except Exception:  # noqa: BLE001
    pass
json.dump(res, open(f"{out}/warm-start.json", "w"), indent=2)
print(json.dumps({"healthy_s": [s.get("healthy_s") for s in res["starts"]],
                  "cache_mb": res["cache_mb"]}))
PY
echo "phases: $(phases_json)"
exit 0
