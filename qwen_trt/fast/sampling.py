"""The one token sampler of both torch paths (the HF ``torch`` backend and the fast decoder).

It can live inside a CUDA graph: no host syncs and no RNG calls when a token is picked. Request
settings sit in small device buffers with one ROW per request (temperature, top-p, top-k,
penalties, the pre-drawn random numbers, the step, the tokens generated so far), so a batched
decoder picks a token for every row in one call, and one seed gives the same tokens on either
path.

Per row, in order:

1. penalties over the tokens GENERATED so far in this request (not the prompt: a chat prompt is
   the whole conversation plus template tokens, which a reply may and must repeat):
   ``repetition_penalty`` with Hugging Face semantics (a seen token's logit is divided by it when
   positive, multiplied when negative), then ``presence_penalty`` subtracted once per distinct
   seen token (OpenAI semantics). Neutral values (1.0, 0.0) leave logits untouched;
2. temperature 0 is greedy (argmax);
3. otherwise temperature, top-k, then the top-p nucleus (a token is dropped when the mass
   before it already reaches top_p; the top token always stays), and inverse-CDF sampling with
   the row's pre-drawn uniform for this step (drawn at request start from its seeded generator).
"""
from __future__ import annotations

import torch

from qwen_trt.params import SamplingParams

Kind = str   # "greedy" | "topk" | "full", plus "+penalties" when any row uses penalties
TOPK_CAP = 64   # top_k up to this uses a cheap topk; larger (or 0 = off) sorts the whole vocab
PENALTIES = "+penalties"


def sampler_kind(params: SamplingParams) -> Kind:
    """The kind of pick (one CUDA graph each) that serves ``params``."""
    base = "greedy" if params.greedy else "topk" if 0 < params.top_k <= TOPK_CAP else "full"
    return base + PENALTIES if params.penalized else base


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's random generator: seeded with ``params.seed``, else from OS entropy."""
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


class SamplerState(torch.nn.Module):
    """Sampling settings, random numbers and generated-token sets of ``rows`` requests, as fixed
    device buffers (safe to capture in a CUDA graph)."""

    def __init__(self, max_tokens: int, vocab: int, device, rows: int = 1) -> None:
        super().__init__()

        def buf(name: str, *shape: int, dtype=torch.float32, fill=0) -> None:
            self.register_buffer(name, torch.full(shape, fill, dtype=dtype, device=device))

        buf("temperature", rows)
        buf("top_p", rows, fill=1)
        buf("top_k", rows, dtype=torch.long, fill=vocab)
        buf("presence", rows)
        buf("repetition", rows, fill=1)
        buf("uniforms", rows, max_tokens)
        buf("step", rows, dtype=torch.long)
        buf("seen", rows, vocab, dtype=torch.bool)

    def set(self, params: SamplingParams, row: int = 0) -> None:
        """Load ``params`` into ``row`` for a new request: step 0, nothing generated yet."""
        self.step[row] = 0
        self.seen[row] = False
        self.temperature[row] = 0.0 if params.greedy else params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k if params.top_k > 0 else self.seen.shape[1]
        self.presence[row] = params.presence_penalty
        self.repetition[row] = params.repetition_penalty
        gen = make_generator(params, self.uniforms.device)
        if gen is not None:
            n = min(params.max_new_tokens, self.uniforms.shape[1])
            self.uniforms[row, :n] = torch.rand(n, generator=gen, device=self.uniforms.device)

    def advance(self, tokens: torch.Tensor) -> None:
        """Record the picked ``tokens [rows]`` (for the penalties) and move every row a step."""
        self.seen.scatter_(1, tokens.view(-1, 1), True)
        self.step.add_(1)

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 ``logits [rows, vocab]`` with each row's penalties on its generated tokens."""
        rep = self.repetition.unsqueeze(-1)
        repeated = torch.where(logits > 0, logits / rep, logits * rep)
        return torch.where(self.seen, repeated - self.presence.unsqueeze(-1), logits)


def pick(logits: torch.Tensor, kind: Kind, st: SamplerState) -> torch.Tensor:
    """One token id per row (int64 ``[rows]``) from ``logits [rows, vocab]``; advances nothing."""
    base, penalties = kind.removesuffix(PENALTIES), kind.endswith(PENALTIES)
    if not penalties and base == "greedy":
        return torch.argmax(logits, dim=-1)
    lf = logits.float()
    if penalties:
        lf = st.penalize(lf)
    greedy = torch.argmax(lf, dim=-1)
    if base == "greedy":
        return greedy
    if base == "topk":
        vals, idx = torch.topk(lf, min(TOPK_CAP, lf.shape[-1]), dim=-1)
    else:
        vals, idx = torch.sort(lf, dim=-1, descending=True)
    temp = st.temperature.unsqueeze(-1)
    vals = vals / torch.where(temp > 0, temp, torch.ones_like(temp))
    ranks = torch.arange(vals.shape[-1], device=vals.device)
    vals = vals.masked_fill(ranks >= st.top_k.unsqueeze(-1), float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(before >= st.top_p.unsqueeze(-1), 0.0)
    cum = torch.cumsum(probs, dim=-1)
    u = st.uniforms.gather(1, st.step.unsqueeze(-1)) * cum[..., -1:]
    choice = (cum < u).sum(-1).clamp(max=vals.shape[-1] - 1)
    sampled = idx.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    return torch.where(st.temperature > 0, sampled, greedy)
