"""Decode attention (one query token, GQA) over the static KV cache.

Two implementations of the same function ``attend(q, k_cache, v_cache, pos, kv_len)``:

* ``math``: matmuls + masked softmax over the first ``kv_len`` cache slots (any device; the
  reference, and what inductor fuses when Triton is absent);
* ``triton``: split-K flash-decoding in two Triton kernels (partial softmax per ``SPLIT``-slot
  chunk, then a merge), reading only slots ``0..pos``. ``pos`` is read on the device, so one
  CUDA graph serves every position and no KV-length buckets are needed. Exposed to
  ``torch.compile`` as the custom op ``qwen_trt::decode_attention``.

Shapes: ``q [heads, d]``, caches ``[kv_heads, slots, d]``, ``pos [1]`` int64; out ``[heads, d]``.
"""
from __future__ import annotations

import os

import torch

from qwen_trt.errors import first_line
from qwen_trt.fast.kernels.kernel_parts import (load_kv, merge_splits, rope_group, rope_rows,
                                        softmax_step, store_partial, write_new_kv)
from qwen_trt.fast.options import options
from qwen_trt.fast.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled

# Measured on an H200 (python -m qwen_trt.bench.kernel_bench --sweep): about 7 / 9 us per layer
# at 512 / 2048 tokens of context, against 10.2 / 11.2 with 128-slot splits of 32.
SPLIT = 64       # cache slots per program of the first kernel
ROPE_SPLIT = 64   # the same for rope_decode_attention, whose programs also norm and rotate q
                  # and load their K/V tile before the PDL wait (H200, docs/benchmarks.md:
                  # 64 beat 128 with the preload, 128 beat 64 and 32 without it)
BLOCK_N = 64     # slots per inner iteration
WARPS = 4

try:  # Triton comes with CUDA builds of torch; CPU-only installs lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def math_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                kv_pos: torch.Tensor) -> torch.Tensor:
    """Reference: attend to slots ``kv_pos = arange(kv_len)`` that are ``<= pos``."""
    kvh, _, d = k_cache.shape
    group = q.shape[0] // kvh
    kv_len = kv_pos.shape[0]
    kc = k_cache.narrow(1, 0, kv_len)                                   # [kvh, L, d]
    vc = v_cache.narrow(1, 0, kv_len)
    s = torch.matmul(q.view(kvh, group, d), kc.transpose(1, 2)).float() * d ** -0.5
    s = s.masked_fill(~(kv_pos <= pos), float("-inf"))
    p = torch.softmax(s, dim=-1).to(vc.dtype)
    return torch.matmul(p, vc).reshape(q.shape)


if triton is not None:
    @triton.jit
    def _partial_kernel(src_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr,
                        m_ptr, l_ptr, acc_ptr, stride_kh, stride_ks, n_splits, scale, eps,
                        HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                        D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                        IEEE: tl.constexpr, PDL: tl.constexpr, ROPE: tl.constexpr,
                        PRELOAD: tl.constexpr):
        """Program ``(kv head, split)``: the online softmax of the query heads of one kv head
        over ``SPLIT`` cache slots, for the merge kernel.

        ``src_ptr`` is ``q [heads, d]`` (its norms, RoPE and the cache write done by
        ``qk_rope_cache`` before), or with ``ROPE`` the fused projection ``qkv``: each
        program then norms and rotates its query heads itself, and the program whose split
        holds ``pos`` writes the new key and value first (same rounding as the kernel apart).

        ``PRELOAD`` (``ROPE`` only): the position and the first tile of cached keys/values
        were written by earlier steps, not by the kernel before this one, so they are loaded
        before the PDL wait -- the cache read overlaps the qkv projection's tail -- and the new
        token's row of that tile is patched in registers."""
        kh = tl.program_id(0)
        sp = tl.program_id(1)
        dims = tl.arange(0, D)
        start = sp * SPLIT
        if PRELOAD:
            pos = tl.load(pos_ptr)
            end = tl.minimum(start + SPLIT, pos + 1)
            slots0 = start + tl.arange(0, BLOCK_N)
            ok0 = slots0 < end
            k_pre, v_pre = load_kv(k_ptr, v_ptr, kh, slots0, ok0, dims, stride_kh, stride_ks)
        if PDL:   # q / qkv (and the new cache slot) come from the previous kernel
            gdc_launch_dependents()
            gdc_wait()
        if not PRELOAD:
            pos = tl.load(pos_ptr)
            end = tl.minimum(start + SPLIT, pos + 1)
            slots0 = pos           # (unused without the preload)
            k_pre = 0.0
            v_pre = 0.0
        if start <= pos:
            rows = tl.arange(0, GROUP_PAD)
            head = kh * GROUP + rows
            row_ok = rows < GROUP
            if ROPE:
                half: tl.constexpr = D // 2
                i = tl.arange(0, half)
                c1, c2, s1, s2 = rope_rows(cos_ptr, sin_ptr, pos * D, i, half)
                if pos < start + SPLIT:   # this split holds the new token: K/V into the cache
                    slot = kh * stride_kh + pos * stride_ks
                    k_pre, v_pre = write_new_kv(   # (and into the preloaded tile's row)
                        src_ptr + (HEADS + kh) * D, src_ptr + (HEADS + HEADS // GROUP + kh) * D,
                        kn_ptr, k_ptr + slot, v_ptr + slot, c1, c2, s1, s2, eps, slots0, pos,
                        k_pre, v_pre, D, PRELOAD)
                    tl.debug_barrier()   # the block's own writes, visible to its loads below
                q = rope_group(src_ptr, qn_ptr, kh * GROUP, c1, c2, s1, s2, eps, GROUP,
                               GROUP_PAD, D)
            else:
                q = tl.load(src_ptr + head[:, None] * D + dims[None, :], mask=row_ok[:, None],
                            other=0.0)
            m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([GROUP_PAD], tl.float32)
            acc = tl.zeros([GROUP_PAD, D], tl.float32)
            for n0 in tl.static_range(0, SPLIT, BLOCK_N):   # masked past ``end``
                slots = start + n0 + tl.arange(0, BLOCK_N)
                ok = slots < end
                if PRELOAD and n0 == 0:
                    k = k_pre
                    v = v_pre
                else:
                    k, v = load_kv(k_ptr, v_ptr, kh, slots, ok, dims, stride_kh, stride_ks)
                m_i, l_i, acc = softmax_step(q, k, v, ok[None, :], m_i, l_i, acc, scale, IEEE,
                                             False)
            store_partial(m_ptr, l_ptr, acc_ptr, head * n_splits + sp, m_i, l_i, acc, row_ok,
                          dims, D)

    @triton.jit
    def _merge_kernel(m_ptr, l_ptr, acc_ptr, pos_ptr, out_ptr,
                      N_SPLITS: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                      CHUNK: tl.constexpr, PDL: tl.constexpr):
        h = tl.program_id(0)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        out = merge_splits(m_ptr, l_ptr, acc_ptr, h * N_SPLITS, tl.load(pos_ptr) // SPLIT + 1,
                           D, CHUNK)
        tl.store(out_ptr + h * D + tl.arange(0, D), out.to(out_ptr.dtype.element_ty))


def _split_attend(src: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  pos: torch.Tensor, heads: int, split: int, block_n: int, warps: int,
                  rope: tuple | None = None) -> torch.Tensor:
    """Both kernels: ``src`` is ``q`` (``rope`` None) or ``qkv`` with ``rope = (q_norm,
    k_norm, cos, sin, eps)``. Returns ``[heads, d]``."""
    kvh, slots, d = k_cache.shape
    if rope is not None and (v_cache.stride() != k_cache.stride() or d & (d - 1)):
        raise ValueError("rope_decode_attention needs K and V caches of one layout and a "
                         "power-of-two head_dim")
    group = heads // kvh
    block_n = min(block_n, split)
    n_splits = triton.cdiv(slots, split)
    dev = src.device
    m = torch.empty(heads, n_splits, dtype=torch.float32, device=dev)
    l_ = torch.empty(heads, n_splits, dtype=torch.float32, device=dev)
    acc = torch.empty(heads, n_splits, d, dtype=torch.float32, device=dev)
    out = torch.empty(heads, d, dtype=src.dtype, device=dev)
    q_norm, k_norm, cos, sin, eps = rope if rope is not None else (src, src, src, src, 0.0)
    pdl = pdl_enabled(dev)
    _partial_kernel[(kvh, n_splits)](
        src, q_norm, k_norm, cos, sin, pos, k_cache, v_cache, m, l_, acc, k_cache.stride(0),
        k_cache.stride(1), n_splits, d ** -0.5, eps, HEADS=heads, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d, SPLIT=split, BLOCK_N=block_n,
        IEEE=src.dtype == torch.float32, PDL=pdl, ROPE=rope is not None,
        PRELOAD=rope is not None and options().attn_preload,
        num_warps=warps, **launch_kwargs(pdl))
    _merge_kernel[(heads,)](m, l_, acc, pos, out, N_SPLITS=n_splits, D=d, SPLIT=split,
                            CHUNK=32, PDL=pdl, num_warps=4, **launch_kwargs(pdl))
    return out


def rope_decode_attention(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
                          heads: int, split: int | None = None, block_n: int = BLOCK_N,
                          warps: int = WARPS) -> torch.Tensor:
    """:func:`~qwen_trt.fast.kernels.rope_cache.qk_rope_cache` then :func:`decode_attention` in two
    kernels instead of three: the q/k norms, RoPE and the cache write happen in the first
    attention kernel. ``qkv [(heads + 2 kv) d]`` -> ``[heads, d]``; writes K/V at ``pos``."""
    split = split or options().attn_split or ROPE_SPLIT
    return _split_attend(qkv, k_cache, v_cache, pos, heads, split, block_n, warps,
                         rope=(q_norm, k_norm, cos, sin, eps))


def _triton_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   pos: torch.Tensor, split: int = SPLIT, block_n: int = BLOCK_N,
                   warps: int = WARPS) -> torch.Tensor:
    return _split_attend(q.contiguous(), k_cache, v_cache, pos, q.shape[0], split, block_n,
                         warps)


@torch.library.custom_op("qwen_trt::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     pos: torch.Tensor) -> torch.Tensor:
    """Triton flash-decoding; see the module docstring."""
    return _triton_attend(q, k_cache, v_cache, pos)


@decode_attention.register_fake
def _(q, k_cache, v_cache, pos):
    return torch.empty_like(q)


def triton_usable(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def check_triton(device: torch.device, dtype: torch.dtype, kv_heads: int, heads: int,
                 head_dim: int, slots: int, tol: float = 2e-2) -> str | None:
    """Compare the Triton kernels with :func:`math_attend` on random data at a few positions;
    None if they agree, else a one-line reason (the caller falls back to ``math``)."""
    try:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(heads, head_dim, generator=g, device=device).to(dtype)
        k = torch.randn(kv_heads, slots, head_dim, generator=g, device=device).to(dtype)
        v = torch.randn(kv_heads, slots, head_dim, generator=g, device=device).to(dtype)
        kv_pos = torch.arange(slots, device=device)
        for p in sorted({0, 1, SPLIT - 1, SPLIT, 2 * SPLIT + 5, slots // 2, slots - 1}):
            if p >= slots:
                continue
            pos = torch.tensor([p], device=device)
            ref = math_attend(q.float(), k.float(), v.float(), pos, kv_pos)
            got = decode_attention(q, k, v, pos).float()
            err = ((got - ref).norm() / ref.norm()).item()
            if not err < tol:
                return f"triton decode attention differs from the reference at pos {p} ({err:.2e})"
    except Exception as e:  # any compile/launch failure means: use the math path
        return first_line(f"triton decode attention unavailable: {type(e).__name__}: {e}")
    return None
