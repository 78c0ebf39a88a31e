#!/usr/bin/env bash
# Phase `ab` of scripts/device.sh: a change of the engine stack checked on the GPU: the batch-1 fast path
# benchmarked on a copy of an earlier tree (BASE) and on this tree, alternated (BASE, this,
# BASE, this) so drift hits both alike, then the CUDA tests of this tree under what time is left.
#
#   mkdir .dev-base && git archive <commit> qwen_trt pyproject.toml | tar -x -C .dev-base
#   (device) bash scripts/device.sh ab        # results flat in $OUT
#
# Environment: OUT (default build/out/device), BASE (default .dev-base), DEADLINE_S (540),
# TESTS (default: the fast path's, the batched runner's and the constrained-decoding CUDA tests).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/out/device}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
BASE=${BASE:-.dev-base}
DEADLINE_S=${DEADLINE_S:-540}
TESTS=${TESTS:-tests/test_fast_cuda.py tests/test_batched_cuda.py tests/test_constrained_cuda.py}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T0=$SECONDS
left() { echo $((DEADLINE_S - (SECONDS - T0))); }
nvidia-smi --query-gpu=name,uuid,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
bench() {   # DIR LABEL
  local t=$SECONDS
  (cd "$1" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 120 python3 -m qwen_trt bench --random-weights \
      --shape qwen3-4b --paths fast --prompt-lens 512 --repeats 3 --out "$OUT/$2.json") \
      >"$OUT/$2.log" 2>&1
  echo "[check] $2: rc $? in $((SECONDS - t)) s"
}
bench "$BASE" base-1
bench . this-1
bench "$BASE" base-2
bench . this-2
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1]); rows = {}
for f in sorted(out.glob("*-[12].json")):
    r = [x for x in json.loads(f.read_text())["rows"] if x["path"] == "fast"][0]
    rows[f.stem] = {"decode_tok_s": r["decode_tok_s"], "ttft_ms_p50": r["ttft_ms_p50"]}
    print(f"[check] {f.stem}: {r['decode_tok_s']:.1f} tok/s, TTFT {r['ttft_ms_p50']:.2f} ms")
b = [v for k, v in rows.items() if k.startswith("base")]; t = [v for k, v in rows.items() if k.startswith("this")]
if b and t:
    mean = lambda xs, k: sum(x[k] for x in xs) / len(xs)
    summary = {"runs": rows, "decode_ratio": mean(t, "decode_tok_s") / mean(b, "decode_tok_s"),
               "ttft_ratio": mean(t, "ttft_ms_p50") / mean(b, "ttft_ms_p50")}
    print(f"[check] this / base: decode {summary['decode_ratio']:.3f}x, TTFT {summary['ttft_ratio']:.3f}x")
    (out / "ab-summary.json").write_text(json.dumps(summary, indent=1))
PY
L=$(left); [ "$L" -lt 30 ] && L=30
echo "[check] CUDA tests, ${L} s left"
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "$L" python3 -m pytest -q -p no:cacheprovider -m cuda $TESTS 2>&1 \
  | tr '\r' '\n' | grep -v '%|' >"$OUT/cuda-tests.log"
echo "[check] tests rc ${PIPESTATUS[0]}"; tail -25 "$OUT/cuda-tests.log"
