"""Token choice that can live inside a CUDA graph: no host syncs, no RNG calls at replay time.

Request settings sit in small device buffers, and the random numbers for a whole request are
drawn up front (one per token, from the request's seeded generator), so a captured graph
replays any temperature / top-p / top-k and stays reproducible for a given seed.

Filters match :mod:`qwen_trt.backends.sampling`: temperature, then top-k, then the top-p nucleus (a token
is dropped when the mass before it already reaches top_p). Inverse-CDF sampling over the kept
tokens with the pre-drawn uniform.
"""
from __future__ import annotations

from typing import Literal

import torch

from qwen_trt.params import SamplingParams
from qwen_trt.backends.sampling import make_generator

Kind = Literal["greedy", "topk", "full"]
TOPK_CAP = 64   # top_k up to this uses a cheap topk; larger (or 0 = off) sorts the whole vocab


def sampler_kind(params: SamplingParams) -> Kind:
    if params.greedy:
        return "greedy"
    return "topk" if 0 < params.top_k <= TOPK_CAP else "full"


class SamplerState(torch.nn.Module):
    """Per-request sampling settings and random numbers, as fixed device buffers."""

    def __init__(self, max_tokens: int, device) -> None:
        super().__init__()
        self.register_buffer("temperature", torch.ones(1, device=device))
        self.register_buffer("top_p", torch.ones(1, device=device))
        self.register_buffer("top_k", torch.zeros(1, dtype=torch.long, device=device))
        self.register_buffer("uniforms", torch.zeros(max_tokens, device=device))
        self.register_buffer("step", torch.zeros(1, dtype=torch.long, device=device))

    def set(self, params: SamplingParams, vocab: int) -> None:
        """Load ``params`` for a new request; ``step`` restarts at 0."""
        self.step.zero_()
        if params.greedy:
            return
        self.temperature.fill_(params.temperature)
        self.top_p.fill_(params.top_p)
        self.top_k.fill_(params.top_k if params.top_k > 0 else vocab)
        n = min(params.max_new_tokens, self.uniforms.numel())
        gen = make_generator(params, self.uniforms.device)
        self.uniforms[:n] = torch.rand(n, generator=gen, device=self.uniforms.device)


def pick(logits: torch.Tensor, kind: Kind, st: SamplerState) -> torch.Tensor:
    """One token id ``[1]`` (int64) from ``logits [1, vocab]``; advances nothing."""
    if kind == "greedy":
        return torch.argmax(logits, dim=-1)
    lf = logits.float()
    if kind == "topk":
        vals, idx = torch.topk(lf, min(TOPK_CAP, lf.shape[-1]), dim=-1)
    else:
        vals, idx = torch.sort(lf, dim=-1, descending=True)
    vals = vals / st.temperature
    ranks = torch.arange(vals.shape[-1], device=vals.device)
    vals = vals.masked_fill(ranks >= st.top_k, float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(before >= st.top_p, 0.0)
    cum = torch.cumsum(probs, dim=-1)
    u = st.uniforms.index_select(0, st.step) * cum[..., -1]
    choice = (cum < u.unsqueeze(-1)).sum(-1).clamp(max=vals.shape[-1] - 1)
    return idx.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
