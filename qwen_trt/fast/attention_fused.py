"""The whole attention of one decode step in one kernel, from the fused q/k/v projection.

``attend_qkv(qkv, ...)`` takes ``qkv [heads*d + 2*kv_heads*d]`` of the token at ``pos`` (a
device tensor) and returns the attention output ``[heads, d]``. One program per (kv head,
``SPLIT``-slot chunk of the cache) that holds slots ``<= pos``:

1. It computes the query heads of its kv head: RMSNorm with ``q_norm`` and the rotary embedding
   (``rope(rms_norm(q))``, rounded like the unfused PyTorch ops, see
   :func:`attend_qkv_reference`).
2. The program whose chunk holds ``pos`` also normalises and rotates the new key, and writes it
   and the value into the cache at ``pos`` before reading its chunk.
3. Flash-decoding over the chunk (online softmax in float32), ``tl.dot`` with the query rows
   padded to 16.
4. With one chunk the result is final. Otherwise each program stores its partial (max, sum,
   weighted values) and takes a ticket; the last program of the kv head merges the partials.
   The ticket counters return to zero after every call.

This replaces three kernels per layer (q/k norm + RoPE + cache write, partial attention, merge):
two fewer kernel boundaries. With PDL (:mod:`qwen_trt.fast.pdl`) the program loads the norm
weights, then waits for the projection kernel.
"""
from __future__ import annotations

import torch

from qwen_trt.fast.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

SPLIT = 64       # cache slots per program
BLOCK_N = 64     # slots per inner iteration
WARPS = 4
MERGE_CHUNK = 8


if triton is not None:
    @triton.jit
    def _norm_rope(x1, x2, g1, g2, c1, c2, s1, s2, eps, D: tl.constexpr, dt: tl.constexpr):
        """``rope(rms_norm(x))`` on rows split in halves ``x1, x2`` (float32 in, dt out)."""
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
        n1 = (g1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        n2 = (g2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        o1 = ((n1 * c1).to(dt).to(tl.float32) + (-n2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((n2 * c2).to(dt).to(tl.float32) + (n1 * s2).to(dt).to(tl.float32)).to(dt)
        return o1, o2

    @triton.jit
    def _attend_qkv_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr,
                           m_ptr, l_ptr, acc_ptr, count_ptr, out_ptr,
                           stride_kh, stride_ks, scale, eps,
                           HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                           GROUP_M: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                           SPLIT: tl.constexpr,
                           BLOCK_N: tl.constexpr, N_SPLITS: tl.constexpr,
                           MERGE_CHUNK: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        kh = tl.program_id(0)
        sp = tl.program_id(1)
        half: tl.constexpr = D // 2
        i = tl.arange(0, half)
        dt = qkv_ptr.dtype.element_ty
        # constants first (PDL): the norm weights
        qn1 = tl.load(qn_ptr + i).to(tl.float32)[None, :]
        qn2 = tl.load(qn_ptr + half + i).to(tl.float32)[None, :]
        kn1 = tl.load(kn_ptr + i).to(tl.float32)[None, :]
        kn2 = tl.load(kn_ptr + half + i).to(tl.float32)[None, :]
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        pos = tl.load(pos_ptr)
        start = sp * SPLIT
        if start <= pos:
            c1 = tl.load(cos_ptr + pos * D + i).to(tl.float32)[None, :]
            c2 = tl.load(cos_ptr + pos * D + half + i).to(tl.float32)[None, :]
            s1 = tl.load(sin_ptr + pos * D + i).to(tl.float32)[None, :]
            s2 = tl.load(sin_ptr + pos * D + half + i).to(tl.float32)[None, :]
            rows = tl.arange(0, GROUP_PAD)
            row_ok = rows < GROUP
            head = kh * GROUP + rows
            x1 = tl.load(qkv_ptr + head[:, None] * D + i[None, :], mask=row_ok[:, None],
                         other=0.0).to(tl.float32)
            x2 = tl.load(qkv_ptr + head[:, None] * D + half + i[None, :], mask=row_ok[:, None],
                         other=0.0).to(tl.float32)
            q1, q2 = _norm_rope(x1, x2, qn1, qn2, c1, c2, s1, s2, eps, D, dt)
            end = tl.minimum(start + SPLIT, pos + 1)
            if pos < start + SPLIT:   # this chunk holds the new slot: write k and v there
                kbase = qkv_ptr + (HEADS + kh) * D
                y1 = tl.load(kbase + i).to(tl.float32)[None, :]
                y2 = tl.load(kbase + half + i).to(tl.float32)[None, :]
                k1, k2 = _norm_rope(y1, y2, kn1, kn2, c1, c2, s1, s2, eps, D, dt)
                slot = kh * stride_kh + pos * stride_ks
                tl.store(k_ptr + slot + i[None, :], k1)
                tl.store(k_ptr + slot + half + i[None, :], k2)
                vbase = qkv_ptr + (HEADS + KV_HEADS + kh) * D
                dd = tl.arange(0, D)
                tl.store(v_ptr + slot + dd, tl.load(vbase + dd))
                tl.debug_barrier()   # the block's own global writes are visible after this
            dims = tl.arange(0, D)
            m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([GROUP_PAD], tl.float32)
            acc = tl.zeros([GROUP_PAD, D], tl.float32)
            for n0 in tl.static_range(0, SPLIT, BLOCK_N):   # masked past ``end``
                slots = start + n0 + tl.arange(0, BLOCK_N)
                ok = slots < end
                off = kh * stride_kh + slots[:, None] * stride_ks
                ka = tl.load(k_ptr + off + i[None, :], mask=ok[:, None], other=0.0)
                kb = tl.load(k_ptr + off + half + i[None, :], mask=ok[:, None], other=0.0)
                v = tl.load(v_ptr + off + dims[None, :], mask=ok[:, None], other=0.0)
                if IEEE:   # float32 models: exact products (tl.dot defaults to tf32)
                    s = (tl.dot(q1, tl.trans(ka), input_precision="ieee")
                         + tl.dot(q2, tl.trans(kb), input_precision="ieee")) * scale
                else:
                    s = (tl.dot(q1, tl.trans(ka)) + tl.dot(q2, tl.trans(kb))) * scale
                s = tl.where(ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            active = pos // SPLIT + 1
            out_off = head[:, None] * D + dims[None, :]
            if active == 1:
                tl.store(out_ptr + out_off, (acc / l_i[:, None]).to(dt), mask=row_ok[:, None])
            else:
                part = (kh * N_SPLITS + sp) * GROUP_PAD + rows
                tl.store(m_ptr + part, m_i, mask=row_ok)
                tl.store(l_ptr + part, l_i, mask=row_ok)
                tl.store(acc_ptr + part[:, None] * D + dims[None, :], acc, mask=row_ok[:, None])
                tl.debug_barrier()   # every thread's partial is written before the ticket
                ticket = tl.atomic_add(count_ptr + kh, 1, sem="acq_rel")
                if ticket == active - 1:   # the last program of this kv head merges
                    tl.store(count_ptr + kh, 0)
                    _merge(m_ptr, l_ptr, acc_ptr, out_ptr, kh, active, GROUP, GROUP_M,
                           GROUP_PAD, D, N_SPLITS, MERGE_CHUNK, dt)

    @triton.jit
    def _merge(m_ptr, l_ptr, acc_ptr, out_ptr, kh, active, GROUP: tl.constexpr,
               GM: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, N_SPLITS: tl.constexpr,
               CHUNK: tl.constexpr, dt: tl.constexpr):
        # Only the GROUP real rows (padded to a power of two GM, not to 16): small tiles.
        rows = tl.arange(0, GM)
        dims = tl.arange(0, D)
        row_ok = (rows < GROUP)[None, :]
        top = tl.full([GM], 0.0, tl.float32) - float("inf")
        for c in tl.static_range(0, N_SPLITS, CHUNK):
            if c < active:
                sp = c + tl.arange(0, CHUNK)
                part = (kh * N_SPLITS + sp[:, None]) * GROUP_PAD + rows[None, :]   # [CHUNK, GM]
                m = tl.load(m_ptr + part, mask=(sp < active)[:, None] & row_ok,
                            other=float("-inf"), cache_modifier=".cg")
                top = tl.maximum(top, tl.max(m, 0))
        total = tl.zeros([GM], tl.float32)
        acc = tl.zeros([GM, D], tl.float32)
        for c in tl.static_range(0, N_SPLITS, CHUNK):
            if c < active:
                sp = c + tl.arange(0, CHUNK)
                ok = (sp < active)[:, None] & row_ok
                part = (kh * N_SPLITS + sp[:, None]) * GROUP_PAD + rows[None, :]
                m = tl.load(m_ptr + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(l_ptr + part, mask=ok, other=0.0, cache_modifier=".cg")
                a = tl.load(acc_ptr + part[:, :, None] * D + dims[None, None, :],
                            mask=ok[:, :, None], other=0.0, cache_modifier=".cg")  # [CHUNK, GM, D]
                w = tl.exp(m - top[None, :])
                total += tl.sum(w * l_s, 0)
                acc += tl.sum(w[:, :, None] * a, 0)
        head = kh * GROUP + rows
        tl.store(out_ptr + head[:, None] * D + dims[None, :], (acc / total[:, None]).to(dt),
                 mask=(rows < GROUP)[:, None])


class AttendScratch:
    """Per-model scratch of :func:`attend_qkv`: partials and the ticket counters (zeroed once;
    every call leaves them zero)."""

    def __init__(self, kv_heads: int, group: int, head_dim: int, slots: int,
                 device: torch.device, split: int = SPLIT) -> None:
        self.split = split
        self.n_splits = triton.cdiv(slots, split) if triton is not None else -(-slots // split)
        self.group_pad = max(16, 1 << (group - 1).bit_length())
        rows = kv_heads * self.n_splits * self.group_pad
        self.m = torch.empty(rows, dtype=torch.float32, device=device)
        self.l = torch.empty(rows, dtype=torch.float32, device=device)
        self.acc = torch.empty(rows, head_dim, dtype=torch.float32, device=device)
        self.count = torch.zeros(kv_heads, dtype=torch.int32, device=device)


def attend_qkv(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, eps: float, heads: int, scratch: AttendScratch,
               block_n: int = BLOCK_N, warps: int = WARPS) -> torch.Tensor:
    """The fused kernel (module docstring); returns ``[heads, d]`` and writes the caches."""
    kv_heads, slots, d = k_cache.shape
    group = heads // kv_heads
    out = torch.empty(heads, d, dtype=qkv.dtype, device=qkv.device)
    pdl = pdl_enabled(qkv.device)
    _attend_qkv_kernel[(kv_heads, scratch.n_splits)](
        qkv, q_norm, k_norm, cos, sin, pos, k_cache, v_cache, scratch.m, scratch.l, scratch.acc,
        scratch.count, out, k_cache.stride(0), k_cache.stride(1), d ** -0.5, eps,
        HEADS=heads, KV_HEADS=kv_heads, GROUP=group, GROUP_M=1 << (group - 1).bit_length(),
        GROUP_PAD=scratch.group_pad, D=d,
        SPLIT=scratch.split, BLOCK_N=min(block_n, scratch.split), N_SPLITS=scratch.n_splits,
        MERGE_CHUNK=MERGE_CHUNK, IEEE=qkv.dtype == torch.float32, PDL=pdl, num_warps=warps,
        **launch_kwargs(pdl))
    return out


def attend_qkv_reference(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
                         heads: int) -> torch.Tensor:
    """The same with PyTorch ops: what :meth:`Qwen3Fast._qkv` + the cache write +
    :func:`~qwen_trt.fast.attention.math_attend` compute."""
    from qwen_trt.fast.attention import math_attend
    from qwen_trt.fast.gemv import rms_norm_ref

    kv_heads, slots, d = k_cache.shape
    q, k, v = qkv.reshape(-1).split([heads * d, kv_heads * d, kv_heads * d])
    q = rms_norm_ref(q.view(heads, d), q_norm, eps)
    k = rms_norm_ref(k.view(kv_heads, d), k_norm, eps)
    c, s = cos[pos], sin[pos]

    def rot(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1)

    q = q * c + rot(q) * s
    k = k * c + rot(k) * s
    k_cache.index_copy_(1, pos, k.view(kv_heads, 1, d))
    v_cache.index_copy_(1, pos, v.view(kv_heads, 1, d))
    return math_attend(q, k_cache, v_cache, pos, torch.arange(slots, device=qkv.device))
