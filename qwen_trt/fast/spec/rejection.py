"""Exact speculative acceptance (Leviathan et al. 2023, Chen et al. 2023), batched, on the device.

A verify step scores ``k + 1`` positions of a row: the position after the row's last accepted
token and one after each of its ``kr <= k`` draft tokens. From the target's PROCESSED
probabilities at those positions ``p [R, k+1, V]`` (temperature, top-k / top-p / min-p,
penalties and grammar masks already applied by the caller;
:func:`qwen_trt.fast.step.sampling.filtered_probs` gives the sampler's part), the drafts ``d [R, k]`` and the draft's probabilities ``q [R, k, V]`` (None for a
deterministic draft such as n-gram lookup or a greedy EAGLE-3 chain: ``q`` is then one-hot at
``d``), :func:`accept` returns per row

* ``accepted``: how many drafts are kept, ``0..kr`` (draft ``i`` is kept when every draft before
  it was and ``u[i] * q_i(d_i) < p_i(d_i)``, i.e. with probability ``min(1, p/q)``);
* ``tokens [R, k+1]``: the kept drafts, then ONE more token at position ``accepted``: drawn
  from the residual ``norm(max(p - q, 0))`` where draft ``accepted`` was rejected, or from ``p``
  itself (the bonus token) when every draft was kept; ``-1`` after it.

So every row emits ``accepted + 1`` tokens whose joint distribution is exactly the target's
(tests/test_spec_rejection.py checks it with chi-square tests). Greedy rows (``greedy[r]``,
temperature 0) keep a draft while it equals the argmax of ``p`` and then emit the argmax: the
tokens plain greedy decoding gives.

The random numbers come in: ``u [R, >=k]`` for the acceptance tests and ``u2 [R, k+1]`` for the
token drawn at stop position ``j`` (``u2[:, j]``), uniform in ``[0, 1)`` and pre-drawn by the
caller from the request's seeded stream, so a seed replays. Nothing here syncs with the host or
draws random numbers; it works on any device, in float32 on CPU.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Acceptance(NamedTuple):
    """The outcome of :func:`accept` (device tensors); unpacks as ``accepted, tokens``."""

    accepted: torch.Tensor      # int64 [R]: drafts kept, 0..kr
    tokens: torch.Tensor        # int64 [R, k+1]: kept drafts, the drawn token, then -1

    @property
    def emitted(self) -> torch.Tensor:
        """int64 ``[R]``: tokens each row emits this step (``accepted + 1``)."""
        return self.accepted + 1


def residual_distribution(p_j: torch.Tensor, q_j: torch.Tensor | None,
                          d_j: torch.Tensor) -> torch.Tensor:
    """Unnormalized ``max(p - q, 0)`` at the first rejected position: ``p_j [R, V]``, ``q_j
    [R, V]`` (None: one-hot at ``d_j [R]``, so the residual is ``p`` with ``d_j`` taken out)."""
    if q_j is None:
        return p_j.scatter(1, d_j.view(-1, 1), 0.0)
    return (p_j - q_j).clamp_min(0.0)


def draw(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row from unnormalized ``dist [R, V]`` with uniforms
    ``u [R]`` (the sampler's rule: the first index whose cumulative mass exceeds ``u * total``)."""
    cum = torch.cumsum(dist, dim=-1)
    target = u.unsqueeze(-1) * cum[..., -1:]
    return (cum <= target).sum(-1).clamp(max=dist.shape[-1] - 1)


def accept(p: torch.Tensor, d: torch.Tensor, kr: torch.Tensor, q: torch.Tensor | None,
           u: torch.Tensor, u2: torch.Tensor,
           greedy: torch.Tensor | None = None) -> Acceptance:
    """Speculative acceptance for ``R`` rows (module docstring).

    ``p``: float ``[R, k+1, V]`` target probabilities (each row sums to 1: the acceptance test
    compares ``p`` with ``q`` directly; the residual and bonus draws normalize themselves);
    ``d``: int64 ``[R, k]`` drafts (anything past ``kr`` is
    ignored); ``kr``: int64 ``[R]`` drafts per row, ``0..k``; ``q``: float ``[R, k, V]`` draft
    probabilities or None (one-hot at ``d``); ``u``: ``[R, >=k]``, ``u2``: ``[R, k+1]``
    uniforms; ``greedy``: bool ``[R]`` rows decided by argmax (None: none)."""
    rows, k1, vocab = p.shape
    k = k1 - 1
    dev = p.device
    kr = kr.clamp(0, k)
    if k > 0:
        dk = d[:, :k].clamp(0, vocab - 1)            # padding past kr may be anything
        p_d = p[:, :k].gather(2, dk.unsqueeze(-1)).squeeze(-1)                  # [R, k]
        q_d = (q.gather(2, dk.unsqueeze(-1)).squeeze(-1) if q is not None
               else torch.ones_like(p_d))
        ok = u[:, :k].to(p_d.dtype) * q_d < p_d
        if greedy is not None:
            top = p[:, :k].argmax(-1)
            ok = torch.where(greedy.view(-1, 1), dk == top, ok)
        ok = ok & (torch.arange(k, device=dev).view(1, -1) < kr.view(-1, 1))
        accepted = torch.cumprod(ok.long(), dim=1).sum(1)
    else:
        dk = torch.zeros(rows, 0, dtype=torch.long, device=dev)
        accepted = torch.zeros(rows, dtype=torch.long, device=dev)

    row = torch.arange(rows, device=dev)
    p_j = p[row, accepted]                                                      # [R, V]
    if k > 0:
        jd = accepted.clamp(max=k - 1)
        d_j = dk[row, jd]
        q_j = q[row, jd] if q is not None else None
        rejected = (accepted < kr).view(-1, 1)
        res = residual_distribution(p_j, q_j, d_j)
        # a residual with no mass (p == q up to rounding) can only follow a rejection of
        # probability ~0: fall back to p itself there
        empty = res.sum(-1, keepdim=True) <= 0
        dist = torch.where(rejected & ~empty, res, p_j)
    else:
        dist = p_j
    u_j = u2.gather(1, accepted.view(-1, 1)).squeeze(1).to(dist.dtype)
    last = draw(dist, u_j)
    if greedy is not None:
        last = torch.where(greedy, p_j.argmax(-1), last)

    pos = torch.arange(k1, device=dev).view(1, -1)
    drafts = torch.cat([dk, torch.zeros(rows, 1, dtype=torch.long, device=dev)], dim=1)
    acc = accepted.view(-1, 1)
    tokens = torch.where(pos < acc, drafts, torch.where(pos == acc, last.view(-1, 1),
                                                        torch.full_like(drafts, -1)))
    return Acceptance(accepted, tokens)

