"""Decode-step attention prologue in one kernel: q/k RMSNorm, rotary embedding, KV-cache write.

Input is the fused projection ``qkv [heads*d + 2*kv_heads*d]`` of one token at ``pos`` (device
tensor). One program per head:

* query heads: ``rope(rms_norm(q_h, q_norm))`` -> ``q_out[h]``
* key heads:   ``rope(rms_norm(k_h, k_norm))`` -> ``k_cache[h, pos]``
* value heads: ``v_h``                          -> ``v_cache[h, pos]``

Rounding follows the unfused PyTorch ops (see :func:`qk_rope_cache_ref`): norm in float32 then
cast, weight product, ``x*cos`` and ``rotate_half(x)*sin`` each rounded to the model dtype, then
their sum. The rotary tables are ``[slots, d]`` in the model dtype (HF's ``cat(freqs, freqs)``).
"""
from __future__ import annotations

import torch

from qwen_trt.fast.kernel_parts import norm_rope, rope_rows
from qwen_trt.fast.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled
from qwen_trt.fast.reference import split_norm_rope

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


if triton is not None:
    @triton.jit
    def _rope_cache_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr,
                           k_ptr, v_ptr, stride_kh, stride_ks, eps,
                           HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                           PDL: tl.constexpr):
        h = tl.program_id(0)
        if PDL:   # qkv comes from the previous kernel
            gdc_launch_dependents()
            gdc_wait()
        pos = tl.load(pos_ptr)
        half: tl.constexpr = D // 2
        i = tl.arange(0, half)
        dt = qkv_ptr.dtype.element_ty
        x1 = tl.load(qkv_ptr + h * D + i)
        x2 = tl.load(qkv_ptr + h * D + half + i)
        if h < HEADS + KV_HEADS:
            is_q = h < HEADS
            if is_q:
                g1 = tl.load(qn_ptr + i)
                g2 = tl.load(qn_ptr + half + i)
            else:
                g1 = tl.load(kn_ptr + i)
                g2 = tl.load(kn_ptr + half + i)
            c1, c2, s1, s2 = rope_rows(cos_ptr, sin_ptr, pos * D, i, half)
            o1, o2 = norm_rope(x1.to(tl.float32), x2.to(tl.float32), g1.to(tl.float32),
                               g2.to(tl.float32), c1, c2, s1, s2, eps, D, 0, dt)
            o1 = o1.to(dt)
            o2 = o2.to(dt)
            if is_q:
                tl.store(q_out_ptr + h * D + i, o1)
                tl.store(q_out_ptr + h * D + half + i, o2)
            else:
                base = k_ptr + (h - HEADS) * stride_kh + pos * stride_ks
                tl.store(base + i, o1)
                tl.store(base + half + i, o2)
        else:
            base = v_ptr + (h - HEADS - KV_HEADS) * stride_kh + pos * stride_ks
            tl.store(base + i, x1)
            tl.store(base + half + i, x2)


def qk_rope_cache(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
                  heads: int) -> torch.Tensor:
    """Triton kernel (module docstring); returns ``q [heads, d]`` and writes the caches."""
    kv_heads, _, d = k_cache.shape
    if v_cache.stride() != k_cache.stride() or d & (d - 1):
        raise ValueError("qk_rope_cache needs K and V caches of one layout and a power-of-two "
                         "head_dim")
    q = torch.empty(heads, d, dtype=qkv.dtype, device=qkv.device)
    pdl = pdl_enabled(qkv.device)
    _rope_cache_kernel[(heads + 2 * kv_heads,)](
        qkv, q_norm, k_norm, cos, sin, pos, q, k_cache, v_cache, k_cache.stride(0),
        k_cache.stride(1), eps, HEADS=heads, KV_HEADS=kv_heads, D=d, PDL=pdl, num_warps=1,
        **launch_kwargs(pdl))
    return q


def qk_rope_cache_ref(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
                      heads: int) -> torch.Tensor:
    """The same with PyTorch ops (:func:`~qwen_trt.fast.reference.split_norm_rope`)."""
    kv_heads, _, d = k_cache.shape
    q, k, v = split_norm_rope(qkv.reshape(1, -1), pos, cos, sin, q_norm, k_norm, heads,
                              kv_heads, d, eps)
    k_cache.index_copy_(1, pos, k.transpose(0, 1))
    v_cache.index_copy_(1, pos, v.transpose(0, 1))
    return q.reshape(heads, d)
