"""Summaries: one row per (path, prompt length), ratios against the HF baselines, Markdown."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from qwen_trt.bench.measure import RunTiming, percentile


@dataclass
class Row:
    path: str
    prompt_len: int
    new_tokens: int
    runs: int
    ttft_ms_p50: float
    ttft_ms_p95: float
    decode_tok_s: float          # median over runs
    ms_per_token: float
    tokens_ok: bool              # every run produced exactly new_tokens tokens
    peak_mem_gb: float | None = None
    roofline_frac: float | None = None
    vs_hf_eager: float | None = None      # decode speed ratio
    vs_hf_static: float | None = None
    ttft_vs_hf_eager: float | None = None  # HF TTFT / ours (>1 = faster)

    def to_json(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def summarize(path: str, prompt_len: int, new_tokens: int, runs: list[RunTiming]) -> Row:
    ttft = [r.ttft_ms for r in runs]
    rate = percentile([r.decode_tok_s for r in runs], 50)
    return Row(path=path, prompt_len=prompt_len, new_tokens=new_tokens, runs=len(runs),
               ttft_ms_p50=percentile(ttft, 50), ttft_ms_p95=percentile(ttft, 95),
               decode_tok_s=rate, ms_per_token=1e3 / rate if rate and rate == rate else float("nan"),
               tokens_ok=all(r.tokens == new_tokens for r in runs))


def add_ratios(rows: list[Row], weight_bytes: int, copy_tbps: float | None) -> None:
    """Fill roofline fraction and speed ratios against the HF rows of the same prompt length."""
    by = {(r.path, r.prompt_len): r for r in rows}
    for r in rows:
        if copy_tbps:
            r.roofline_frac = weight_bytes * r.decode_tok_s / (copy_tbps * 1e12)
        eager = by.get(("hf-eager", r.prompt_len))
        static = by.get(("hf-static", r.prompt_len))
        if eager:
            r.vs_hf_eager = r.decode_tok_s / eager.decode_tok_s
            r.ttft_vs_hf_eager = eager.ttft_ms_p50 / r.ttft_ms_p50
        if static:
            r.vs_hf_static = r.decode_tok_s / static.decode_tok_s


def _f(v, fmt: str) -> str:
    return "—" if v is None or v != v else format(v, fmt)


def markdown(rows: list[Row]) -> str:
    head = ("| path | prompt | TTFT p50 ms | TTFT p95 ms | decode tok/s | ms/token | × HF eager "
            "| × HF static | roofline | peak GB | tokens ok |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r.path} | {r.prompt_len} | {_f(r.ttft_ms_p50, '.1f')} | {_f(r.ttft_ms_p95, '.1f')} "
            f"| {_f(r.decode_tok_s, '.1f')} | {_f(r.ms_per_token, '.2f')} "
            f"| {_f(r.vs_hf_eager, '.2f')} | {_f(r.vs_hf_static, '.2f')} "
            f"| {_f(None if r.roofline_frac is None else 100 * r.roofline_frac, '.0f')}"
            f"{'' if r.roofline_frac is None else ' %'} | {_f(r.peak_mem_gb, '.1f')} "
            f"| {'yes' if r.tokens_ok else 'NO'} |")
    return "\n".join(lines)
