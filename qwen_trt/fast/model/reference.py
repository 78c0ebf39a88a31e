"""Reference math of the fast path in plain PyTorch ops: RMSNorm and rotary embeddings as HF
computes them (RMSNorm in float32 then cast; rotary tables in float32).

The model (:mod:`qwen_trt.fast.model.model`) uses these on its unfused paths, and the fused kernels'
references (:mod:`qwen_trt.fast.kernels.gemv`, :mod:`qwen_trt.fast.kernels.rope_cache`) check against them; this
module imports none of those, so there is no import circle.
"""
from __future__ import annotations

import torch

from qwen_trt.fast.model.config import FastConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(cfg: FastConfig, max_seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin tables ``[max_seq_len, head_dim]`` (HF's default RoPE)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64,
                                                      device=device).float() / d))
    pos = torch.arange(max_seq_len, device=device).float()
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def split_norm_rope(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    q_norm: torch.Tensor, k_norm: torch.Tensor, heads: int, kv_heads: int,
                    head_dim: int, eps: float):
    """``qkv [T, (heads + 2 kv_heads) * head_dim]`` at ``pos [T]`` -> q, k (per-head RMSNorm
    and rotary) and v, each ``[T, n, head_dim]``."""
    t = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = rms_norm(q.view(t, heads, head_dim), q_norm, eps)
    k = rms_norm(k.view(t, kv_heads, head_dim), k_norm, eps)
    v = v.view(t, kv_heads, head_dim)
    c = cos[pos].unsqueeze(1)
    s = sin[pos].unsqueeze(1)
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    return q, k, v
