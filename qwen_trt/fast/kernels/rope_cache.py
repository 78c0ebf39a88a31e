"""Decode-step attention prologue of one token: q/k RMSNorm, rotary embedding, KV-cache write.

Input is the fused projection ``qkv [heads*d + 2*kv_heads*d]`` of one token at ``pos`` (device
tensor):

* query heads: ``rope(rms_norm(q_h, q_norm))`` -> ``q[h]``
* key heads:   ``rope(rms_norm(k_h, k_norm))`` -> ``k_cache[h, pos]``
* value heads: ``v_h``                          -> ``v_cache[h, pos]``

The static cache ``[kv_heads, slots, d]`` is laid out like one layer of the paged cache with
slot = position, so this is :func:`~qwen_trt.fast.kernels.paged_kernels.paged_rope_cache` for one row
(one Triton kernel). Rounding follows the unfused PyTorch ops (:func:`qk_rope_cache_ref`): norm
in float32 then cast, weight product, ``x*cos`` and ``rotate_half(x)*sin`` each rounded to the
model dtype, then their sum. The rotary tables are ``[slots, d]`` in the model dtype (HF's
``cat(freqs, freqs)``). The batch-1 decode folds this into its attention kernel
(:func:`~qwen_trt.fast.kernels.attention.rope_decode_attention`); this module keeps the separate kernel (the
batched prefill steps and the tests use it).
"""
from __future__ import annotations

import torch

from qwen_trt.fast.kernels.paged_kernels import paged_rope_cache
from qwen_trt.fast.model.reference import split_norm_rope


def qk_rope_cache(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
                  heads: int) -> torch.Tensor:
    """Triton kernel (module docstring); returns ``q [heads, d]`` and writes the caches."""
    q = paged_rope_cache(qkv.reshape(1, -1), q_norm, k_norm, cos, sin, pos, pos, k_cache,
                         v_cache, eps, heads)
    return q.view(heads, -1)


def qk_rope_cache_ref(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
                      heads: int) -> torch.Tensor:
    """The same with PyTorch ops (:func:`~qwen_trt.fast.model.reference.split_norm_rope`)."""
    kv_heads, _, d = k_cache.shape
    q, k, v = split_norm_rope(qkv.reshape(1, -1), pos, cos, sin, q_norm, k_norm, heads,
                              kv_heads, d, eps)
    k_cache.index_copy_(1, pos, k.transpose(0, 1))
    v_cache.index_copy_(1, pos, v.transpose(0, 1))
    return q.reshape(heads, d)
