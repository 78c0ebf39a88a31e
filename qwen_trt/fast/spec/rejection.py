"""Exact acceptance of drafted tokens (placeholder until the full module lands)."""
from __future__ import annotations

import torch


def accept(p, d, kr, q, u, u2):
    """Rows ``R``: target probabilities ``p [R, k+1, V]``, drafts ``d [R, k]`` (``kr`` of them
    per row), draft probabilities ``q [R, k, V]`` or None (deterministic drafts), uniforms
    ``u``/``u2 [R, k+1]`` -> ``(accepted [R], tokens [R, k+1])``."""
    R, k1, V = p.shape
    acc = torch.zeros(R, dtype=torch.long, device=p.device)
    toks = torch.zeros(R, k1, dtype=torch.long, device=p.device)
    for r in range(R):
        a = 0
        n = int(kr[r])
        while a < n:
            t = int(d[r, a])
            qa = 1.0 if q is None else float(q[r, a, t])
            if float(u[r, a]) * qa < float(p[r, a, t]):
                toks[r, a] = t
                a += 1
                continue
            break
        if a < n:
            qv = torch.zeros(V, device=p.device) if q is None else q[r, a]
            if q is None:
                qv[int(d[r, a])] = 1.0
            res = (p[r, a] - qv).clamp_min(0)
        else:
            res = p[r, a]
        cum = torch.cumsum(res, 0)
        x = float(u2[r, a]) * float(cum[-1])
        toks[r, a] = int(min(int((cum <= x).sum()), V - 1))
        acc[r] = a
    return acc, toks
