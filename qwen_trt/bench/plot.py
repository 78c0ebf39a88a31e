"""``qwen-trt bench --plot``: TTFT and decode speed per path and prompt length, as one PNG.

Two panels from a bench JSON (``rows`` of path x prompt length): time to first token (log
scale) and decode tokens/s with the run's roofline (weight bytes / measured copy bandwidth)
drawn as a line. matplotlib is an optional extra (``pip install -e ".[plot]"``);
``python -m qwen_trt.bench.plot docs/measurements/bench-batch1-vs-hf-h200-first-kernels.json docs/bench-h200.png`` redraws a saved run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from qwen_trt.errors import QwenTrtError

LABELS = {"hf-eager": "HF generate (eager)", "hf-static": "HF generate (static cache)",
          "torch": "qwen-trt torch", "fast": "qwen-trt fast path", "trtllm": "TensorRT-LLM"}


def _series(result: dict, key: str) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for row in result.get("rows", []):
        value = row.get(key)
        if value is None:
            continue
        xs, ys = out.setdefault(row["path"], ([], []))
        xs.append(int(row["prompt_len"]))
        ys.append(float(value))
    return out


def plot_result(result: dict, out: str | Path) -> Path:
    """Draw ``result`` (a ``qwen-trt bench`` JSON) into the PNG ``out``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise QwenTrtError('--plot needs matplotlib: pip install -e ".[plot]"') from e
    ttft, tok_s = _series(result, "ttft_ms_p50"), _series(result, "decode_tok_s")
    if not ttft and not tok_s:
        raise QwenTrtError("the bench result has no rows to plot")
    env, model = result.get("env", {}), result.get("model", {})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    lens = sorted({x for series in (ttft, tok_s) for xs, _ in series.values() for x in xs})
    for path, (xs, ys) in ttft.items():
        left.plot(xs, ys, marker="o", label=LABELS.get(path, path))
    left.set(xscale="log", yscale="log", xlabel="prompt length (tokens)",
             ylabel="time to first token, p50 (ms)", title="Time to first token (lower is better)")
    all_ttft = [y for _, ys in ttft.values() for y in ys]
    if all_ttft:
        lo, hi = min(all_ttft), max(all_ttft)
        ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
                 if lo / 2 <= t <= hi * 2]
        left.set_yticks(ticks, [f"{t:g}" for t in ticks])
        left.set_ylim(lo / 1.5, hi * 1.5)
    for path, (xs, ys) in tok_s.items():
        right.plot(xs, ys, marker="o", label=LABELS.get(path, path))
    roof = model.get("roofline_tok_s")
    if roof:
        right.axhline(roof, color="black", linestyle="--", linewidth=1)
        right.annotate(f"roofline {roof:.0f} tok/s (weights / measured copy bandwidth)",
                       (lens[0] if lens else 1, roof), textcoords="offset points",
                       xytext=(2, -12), fontsize=8)
    right.set(xscale="log", xlabel="prompt length (tokens)", ylabel="decode tokens/s, batch 1",
              title="Decode speed (higher is better)")
    right.set_ylim(0, max([roof or 0] + [max(ys) for _, ys in tok_s.values()]) * 1.1)
    for ax in (left, right):
        ax.minorticks_off()
        if lens:
            ax.set_xticks(lens, [str(x) for x in lens])
        ax.grid(True, alpha=0.3)
    right.legend(fontsize=8, loc="center right")
    where = " · ".join(str(v) for v in (env.get("gpu") or env.get("device"), env.get("dtype"),
                                           model.get("name")) if v)
    fig.suptitle(f"qwen-trt bench{' — ' + where if where else ''}", fontsize=10)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def default_png(json_path: str | Path) -> Path:
    return Path(json_path).with_suffix(".png")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or len(argv) > 2:
        print("usage: python -m qwen_trt.bench.plot RESULT.json [OUT.png]", file=sys.stderr)
        return 2
    src = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else default_png(src)
    print(plot_result(json.loads(src.read_text()), out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
