"""Triton kernels of the batched decode step over the paged KV cache (CUDA; Triton's interpreter
on CPU in tests). The cache of one layer is ``[kv_heads, num_blocks * block_size, d]``: a
token's *slot* is ``block * block_size + offset``, and ``block_tables[b, i]`` is the physical
block of a row's tokens ``i * block_size ..``.

* :func:`paged_rope_cache`: per row, q/k RMSNorm + RoPE at the row's position and the K/V write
  at the row's slot (the batched form of :mod:`qwen_trt.fast.kernels.rope_cache`, same rounding).
* :func:`paged_decode_attention`: flash-decoding over per-row lengths through the block tables:
  one program per (row, kv head, ``SPLIT``-token split) for the query heads of that kv head,
  one block of keys per inner step, then a merge of the splits per (row, head). Lengths are read
  on the device, so one CUDA graph serves every mix of lengths up to the table's width.
* :func:`paged_varlen_attention`: causal attention of any mix of prefill chunks and decode rows
  in one launch (the steps that prefill): one program per (``block_q`` query tokens of one
  sequence, kv head) over that sequence's blocks, flash-attention style (online softmax).

The PyTorch references (:func:`paged_attention_ref`) are the CPU path and the tests' oracle.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from qwen_trt.fast.kernels.kernel_parts import (block_slots, load_kv, merge_splits, norm_rope,
                                        rope_group, rope_rows, softmax_step, store_partial,
                                        write_new_kv)
from qwen_trt.fast.options import options
from qwen_trt.fast.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

SPLIT = 64          # tokens per program of the attention's first kernel (a multiple of the block)
# The same for paged_rope_decode_attention, by decode rows; the batched runner's chained decode
# graph on the H200 at ctx 512, ms per step for 1 / 8 / 32 rows, two runs on two machines:
# split 64: 2.451, 2.455 / 3.797, 4.145 / 5.206; split 128: 2.530, 2.534 / 3.824, 4.049 / 4.919.
ROPE_SPLIT_NARROW, NARROW_ROWS = 64, 1
ROPE_SPLIT = 128
WARPS = 4


if triton is not None:
    @triton.jit
    def _paged_rope_cache_kernel(qkv_ptr, stride_row, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr,
                                 slot_ptr, q_out_ptr, k_ptr, v_ptr, stride_kh, stride_ks, eps,
                                 n_rows, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                                 D: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)     # ROWS rows of one head
        h = tl.program_id(1)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        r_ok = row < n_rows
        rm = r_ok[:, None]
        pos = tl.load(pos_ptr + row, mask=r_ok, other=0)
        slot = tl.load(slot_ptr + row, mask=r_ok, other=0)
        half: tl.constexpr = D // 2
        i = tl.arange(0, half)[None, :]
        dt = qkv_ptr.dtype.element_ty
        src = qkv_ptr + row[:, None] * stride_row + h * D
        x1 = tl.load(src + i, mask=rm, other=0.0)
        x2 = tl.load(src + half + i, mask=rm, other=0.0)
        if h < HEADS + KV_HEADS:
            is_q = h < HEADS
            if is_q:
                g1 = tl.load(qn_ptr + i)
                g2 = tl.load(qn_ptr + half + i)
            else:
                g1 = tl.load(kn_ptr + i)
                g2 = tl.load(kn_ptr + half + i)
            pd = pos[:, None] * D
            c1, c2, s1, s2 = rope_rows(cos_ptr, sin_ptr, pd, i, half)
            o1, o2 = norm_rope(x1.to(tl.float32), x2.to(tl.float32), g1.to(tl.float32),
                               g2.to(tl.float32), c1, c2, s1, s2, eps, D, 1, dt)
            o1 = o1.to(dt)
            o2 = o2.to(dt)
            if is_q:
                dst = q_out_ptr + (row[:, None] * HEADS + h) * D
                tl.store(dst + i, o1, mask=rm)
                tl.store(dst + half + i, o2, mask=rm)
            else:
                base = k_ptr + (h - HEADS) * stride_kh + slot[:, None] * stride_ks
                tl.store(base + i, o1, mask=rm)
                tl.store(base + half + i, o2, mask=rm)
        else:
            base = v_ptr + (h - HEADS - KV_HEADS) * stride_kh + slot[:, None] * stride_ks
            tl.store(base + i, x1, mask=rm)
            tl.store(base + half + i, x2, mask=rm)

    @triton.jit
    def _paged_partial_kernel(src_ptr, stride_row, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr,
                              slot_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, m_ptr, l_ptr,
                              acc_ptr, stride_kh, stride_ks, stride_tb, n_splits, scale, eps,
                              HEADS: tl.constexpr, GROUP: tl.constexpr,
                              GROUP_PAD: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                              BS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                              ROPE: tl.constexpr, PRELOAD: tl.constexpr):
        """Program ``(row, kv head, split)``: the online softmax of the query heads of one kv
        head over ``SPLIT`` tokens of the row (one cache block per step), for the merge.

        ``src_ptr`` rows are ``q [B, heads, d]`` (normed, rotated and cached before by
        ``_paged_rope_cache_kernel``), or with ``ROPE`` the fused projection ``qkv`` of decode
        rows (row ``b``'s new token at ``pos[b] = lens[b] - 1``, slot ``slot[b]``): each
        program then norms and rotates its query heads itself, and the program whose split
        holds the new token writes its key and value first (same rounding as apart).

        ``PRELOAD`` (``ROPE`` only): the row's length, first block of the table and that
        block's keys/values (written by earlier steps) are loaded before the PDL wait; the new
        token's row is patched in registers."""
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        dims = tl.arange(0, D)
        start = sp * SPLIT
        if PRELOAD:
            seq_len = tl.load(lens_ptr + b)
            toks0 = start + tl.arange(0, BS)
            ok0 = toks0 < seq_len
            k_pre, v_pre = load_kv(k_ptr, v_ptr, kh,
                                   block_slots(table_ptr, b * stride_tb, start, seq_len, BS), ok0,
                                   dims, stride_kh, stride_ks)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        if not PRELOAD:
            seq_len = tl.load(lens_ptr + b)
            toks0 = start          # (unused without the preload)
            k_pre = 0.0
            v_pre = 0.0
        if start < seq_len:
            row_src = src_ptr + b * stride_row
            rows = tl.arange(0, GROUP_PAD)
            head = kh * GROUP + rows
            row_ok = rows < GROUP
            if ROPE:
                pos = tl.load(pos_ptr + b)
                half: tl.constexpr = D // 2
                i = tl.arange(0, half)
                c1, c2, s1, s2 = rope_rows(cos_ptr, sin_ptr, pos * D, i, half)
                if (pos >= start) & (pos < start + SPLIT):   # the new token: K/V into the cache
                    dst = kh * stride_kh + tl.load(slot_ptr + b).to(tl.int64) * stride_ks
                    k_pre, v_pre = write_new_kv(   # (and into the preloaded block's row)
                        row_src + (HEADS + kh) * D, row_src + (HEADS + HEADS // GROUP + kh) * D,
                        kn_ptr, k_ptr + dst, v_ptr + dst, c1, c2, s1, s2, eps, toks0, pos,
                        k_pre, v_pre, D, PRELOAD)
                    tl.debug_barrier()   # the block's own writes, visible to its loads below
                q = rope_group(row_src, qn_ptr, kh * GROUP, c1, c2, s1, s2, eps, GROUP,
                               GROUP_PAD, D)
            else:
                q = tl.load(row_src + head[:, None] * D + dims[None, :], mask=row_ok[:, None],
                            other=0.0)
            m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([GROUP_PAD], tl.float32)
            acc = tl.zeros([GROUP_PAD, D], tl.float32)
            for n0 in tl.static_range(0, SPLIT, BS):       # one block per step
                first = start + n0
                toks = first + tl.arange(0, BS)
                ok = toks < seq_len
                if PRELOAD and n0 == 0:
                    k = k_pre
                    v = v_pre
                else:
                    slots = block_slots(table_ptr, b * stride_tb, first, seq_len, BS)
                    k, v = load_kv(k_ptr, v_ptr, kh, slots, ok, dims, stride_kh, stride_ks)
                m_i, l_i, acc = softmax_step(q, k, v, ok[None, :], m_i, l_i, acc, scale, IEEE,
                                             True)
            store_partial(m_ptr, l_ptr, acc_ptr, (b * HEADS + head) * n_splits + sp, m_i, l_i,
                          acc, row_ok, dims, D)

    @triton.jit
    def _paged_merge_kernel(m_ptr, l_ptr, acc_ptr, lens_ptr, out_ptr,
                            n_splits, HEADS: tl.constexpr, D: tl.constexpr,
                            SPLIT: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        active = (tl.load(lens_ptr + b) + SPLIT - 1) // SPLIT
        out = merge_splits(m_ptr, l_ptr, acc_ptr, (b * HEADS + h) * n_splits, active,
                           D, CHUNK)
        tl.store(out_ptr + (b * HEADS + h) * D + tl.arange(0, D),
                 out.to(out_ptr.dtype.element_ty))


if triton is not None:
    @triton.jit
    def _varlen_keys(q, q_pos, first, n_keys, s, kh, dims, k_ptr, v_ptr, table_ptr, stride_kh,
                     stride_ks, stride_tb, qk_scale, m_i, l_i, acc, BLOCK_N: tl.constexpr,
                     BS: tl.constexpr, IEEE: tl.constexpr):
        """Keys ``first .. first + BLOCK_N - 1`` of sequence ``s`` into the online softmax
        (each key's block looked up in the table, so BLOCK_N need not match the block size)."""
        toks = first + tl.arange(0, BLOCK_N)
        ok = toks < n_keys
        blk = tl.load(table_ptr + s * stride_tb + toks // BS, mask=ok, other=0).to(tl.int64)
        slots = blk * BS + toks % BS
        k, v = load_kv(k_ptr, v_ptr, kh, slots, ok, dims, stride_kh, stride_ks)
        keep = (toks[None, :] <= q_pos[:, None]) & ok[None, :]
        return softmax_step(q, k, v, keep, m_i, l_i, acc, qk_scale, IEEE, True, True)

    @triton.jit
    def _paged_varlen_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, ctx_ptr, qstart_ptr,
                             qlen_ptr, tile_seq_ptr, tile_q0_ptr, stride_kh, stride_ks,
                             stride_tb, qk_scale, HEADS: tl.constexpr, GROUP: tl.constexpr,
                             GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
                             BLOCK_N: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr,
                             COUNTED: tl.constexpr, PDL: tl.constexpr):
        t = tl.program_id(0)
        kh = tl.program_id(1)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        s = tl.load(tile_seq_ptr + t)
        if s >= 0:
            q0 = tl.load(tile_q0_ptr + t)
            qlen = tl.load(qlen_ptr + s)
            ctx = tl.load(ctx_ptr + s)
            row0 = tl.load(qstart_ptr + s) + q0
            n_q = tl.minimum(qlen - q0, BLOCK_Q)
            # M rows = (query token i, head g of this kv head's group), token-major
            m = tl.arange(0, BLOCK_Q * GROUP_PAD)
            i = m // GROUP_PAD
            g = m % GROUP_PAD
            m_ok = (i < n_q) & (g < GROUP)
            q_pos = ctx - qlen + q0 + i                     # each row's position
            dims = tl.arange(0, D)
            q_off = ((row0 + i) * HEADS + kh * GROUP + g)[:, None] * D + dims[None, :]
            q = tl.load(q_ptr + q_off, mask=m_ok[:, None], other=0.0)
            m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
            acc = tl.zeros([BLOCK_Q * GROUP_PAD, D], tl.float32)
            n_keys = ctx - qlen + q0 + n_q                  # keys the last row of the tile sees
            if COUNTED:   # compiled: a counted loop, which Triton software-pipelines
                for first in range(0, n_keys, BLOCK_N):
                    m_i, l_i, acc = _varlen_keys(q, q_pos, first, n_keys, s, kh, dims, k_ptr,
                                                 v_ptr, table_ptr, stride_kh, stride_ks,
                                                 stride_tb, qk_scale, m_i, l_i, acc, BLOCK_N,
                                                 BS, IEEE)
            else:         # Triton's interpreter cannot count a loop by a loaded bound
                first = 0
                while first < n_keys:
                    m_i, l_i, acc = _varlen_keys(q, q_pos, first, n_keys, s, kh, dims, k_ptr,
                                                 v_ptr, table_ptr, stride_kh, stride_ks,
                                                 stride_tb, qk_scale, m_i, l_i, acc, BLOCK_N,
                                                 BS, IEEE)
                    first += BLOCK_N
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None])


def paged_rope_cache(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
                     heads: int) -> torch.Tensor:
    """``qkv [B, (heads + 2 kv) d]`` -> ``q [B, heads, d]``; writes K/V at ``slots [B]``."""
    kv_heads, _, d = k_cache.shape
    if v_cache.stride() != k_cache.stride() or d & (d - 1) or qkv.stride(-1) != 1:
        raise ValueError("paged_rope_cache needs K and V of one layout, a power-of-two "
                         "head_dim and rows of contiguous qkv")
    b = qkv.shape[0]
    q = torch.empty(b, heads, d, dtype=qkv.dtype, device=qkv.device)
    pdl = pdl_enabled(qkv.device)
    # decode steps: a program per (row, head); prefill steps: 8 rows per program
    rows = 1 if b <= 64 else 8
    _paged_rope_cache_kernel[(triton.cdiv(b, rows), heads + 2 * kv_heads)](
        qkv, qkv.stride(0), q_norm, k_norm, cos, sin, pos, slots, q, k_cache, v_cache,
        k_cache.stride(0), k_cache.stride(1), eps, b, HEADS=heads, KV_HEADS=kv_heads, D=d,
        ROWS=rows, PDL=pdl, num_warps=1 if rows == 1 else 4, **launch_kwargs(pdl))
    return q


def _paged_split_attend(src: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                        heads: int, split: int, rope: tuple | None = None) -> torch.Tensor:
    """Both kernels: rows of ``src`` are ``q`` (``rope`` None) or ``qkv`` with ``rope =
    (q_norm, k_norm, cos, sin, pos, slots, eps)``. Returns ``[B, heads, d]``."""
    kvh, _, d = k_cache.shape
    bsz = src.shape[0]
    split = max(split, block_size)
    if split % block_size or block_size & (block_size - 1) or block_size < 16:
        raise ValueError("paged attention needs a power-of-two block size >= 16 dividing SPLIT")
    if rope is not None and (v_cache.stride() != k_cache.stride() or d & (d - 1)
                             or src.stride(-1) != 1):
        raise ValueError("paged_rope_decode_attention needs K and V of one layout, a "
                         "power-of-two head_dim and rows of contiguous qkv")
    n_splits = triton.cdiv(block_tables.shape[1] * block_size, split)
    dev = src.device
    m = torch.empty(bsz, heads, n_splits, dtype=torch.float32, device=dev)
    l_ = torch.empty(bsz, heads, n_splits, dtype=torch.float32, device=dev)
    acc = torch.empty(bsz, heads, n_splits, d, dtype=torch.float32, device=dev)
    out = torch.empty(bsz, heads, d, dtype=src.dtype, device=dev)
    q_norm, k_norm, cos, sin, pos, slots, eps = (
        rope if rope is not None else (src, src, src, src, seq_lens, seq_lens, 0.0))
    pdl = pdl_enabled(dev)
    _paged_partial_kernel[(bsz, kvh, n_splits)](
        src, src.stride(0), q_norm, k_norm, cos, sin, pos, slots, k_cache, v_cache,
        block_tables, seq_lens, m, l_, acc, k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0), n_splits, d ** -0.5, eps, HEADS=heads,
        GROUP=heads // kvh, GROUP_PAD=max(16, triton.next_power_of_2(heads // kvh)), D=d,
        SPLIT=split, BS=block_size, IEEE=src.dtype == torch.float32, PDL=pdl,
        ROPE=rope is not None,
        PRELOAD=rope is not None and options().attn_preload,
        num_warps=WARPS, **launch_kwargs(pdl))
    chunk = min(32, triton.next_power_of_2(n_splits))
    _paged_merge_kernel[(bsz, heads)](m, l_, acc, seq_lens, out, n_splits, HEADS=heads,
                                      D=d, SPLIT=split, CHUNK=chunk, PDL=pdl, num_warps=4,
                                      **launch_kwargs(pdl))
    return out


def paged_rope_decode_attention(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                                cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                                slots: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, block_tables: torch.Tensor,
                                seq_lens: torch.Tensor, block_size: int, eps: float,
                                heads: int, split: int | None = None) -> torch.Tensor:
    """:func:`paged_rope_cache` then :func:`paged_decode_attention` for decode rows
    (``seq_lens == pos + 1``) in two kernels instead of three: ``qkv [B, (heads + 2 kv) d]``
    -> ``[B, heads, d]``; writes K/V at ``slots [B]``."""
    default = ROPE_SPLIT_NARROW if qkv.shape[0] <= NARROW_ROWS else ROPE_SPLIT
    split = split or options().paged_split or default
    return _paged_split_attend(qkv, k_cache, v_cache, block_tables, seq_lens, block_size,
                               heads, split, rope=(q_norm, k_norm, cos, sin, pos, slots, eps))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                           split: int = SPLIT) -> torch.Tensor:
    """``q [B, heads, d]`` over each row's first ``seq_lens[b]`` tokens -> ``[B, heads, d]``.
    ``block_tables [B, max_blocks]`` int32; entries past a row's length are never read."""
    return _paged_split_attend(q.contiguous(), k_cache, v_cache, block_tables, seq_lens,
                               block_size, q.shape[1], split)


VARLEN_BLOCK_Q = 16  # query tokens per program of the varlen attention (the smallest tried)
VARLEN_TILES = ((16, 4), (32, 4), (32, 8), (64, 8))   # (block_q, warps) timed at warm-up
VARLEN_BLOCK_N = 64  # keys per inner step
_LOG2E = 1.4426950408889634


def varlen_tiles(qlens: Sequence[int], block_q: int = VARLEN_BLOCK_Q
                 ) -> tuple[list[int], list[int]]:
    """The programs of :func:`paged_varlen_attention` for sequences with ``qlens`` query rows:
    ``(tile_seq, tile_q0)``, one entry per ``block_q`` rows of one sequence."""
    tile_seq: list[int] = []
    tile_q0: list[int] = []
    for s, n in enumerate(qlens):
        for q0 in range(0, n, block_q):
            tile_seq.append(s)
            tile_q0.append(q0)
    return tile_seq, tile_q0


def varlen_max_tiles(rows: int, seqs: int, block_q: int = VARLEN_BLOCK_Q) -> int:
    """How many tiles ``rows`` query rows over at most ``seqs`` sequences can need."""
    return rows // block_q + seqs


def paged_varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_ctx: torch.Tensor,
                           seq_qstart: torch.Tensor, seq_qlen: torch.Tensor,
                           tile_seq: torch.Tensor, tile_q0: torch.Tensor, block_size: int,
                           block_q: int = VARLEN_BLOCK_Q, warps: int = 4) -> torch.Tensor:
    """Causal attention of every sequence's query rows over its paged keys, in one launch.

    ``q [T, heads, d]``: sequence ``s`` owns rows ``seq_qstart[s] ..`` (``seq_qlen[s]`` of them),
    its tokens at positions ``seq_ctx[s] - seq_qlen[s] .. seq_ctx[s] - 1``, its keys the first
    ``seq_ctx[s]`` tokens through ``block_tables[s]`` (the rows' own K/V already written). A
    decode row is a sequence of one row; a prefill chunk starts anywhere (after a prefix-cache
    hit or an earlier chunk). Programs: ``tile_seq``/``tile_q0`` (:func:`varlen_tiles`; entries
    ``< 0`` are padding and do nothing), times the kv heads; each holds ``block_q`` tokens ×
    the query heads of one kv head, so K/V are read once per tile for the whole group.
    Everything is read on the device: one CUDA graph serves any mix of sequences and lengths
    whose tiles fit ``tile_seq``. Rows no tile covers come back zero. ``block_q`` and
    ``warps``: the tile shape (the batched model picks the faster at warm-up)."""
    t, heads, d = q.shape
    kvh = k_cache.shape[0]
    group = heads // kvh
    if block_size & (block_size - 1) or block_size < 16 or d & (d - 1):
        raise ValueError("varlen attention needs a power-of-two block size >= 16 and head_dim")
    out = torch.zeros_like(q)
    q = q.contiguous()
    pdl = pdl_enabled(q.device)
    _paged_varlen_kernel[(tile_seq.shape[0], kvh)](
        q, k_cache, v_cache, out, block_tables, seq_ctx, seq_qstart, seq_qlen, tile_seq, tile_q0,
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), d ** -0.5 * _LOG2E,
        HEADS=heads, GROUP=group, GROUP_PAD=triton.next_power_of_2(group), D=d, BLOCK_Q=block_q,
        BLOCK_N=VARLEN_BLOCK_N, BS=block_size, IEEE=q.dtype == torch.float32,
        COUNTED=os.environ.get("TRITON_INTERPRET", "0") != "1", PDL=pdl, num_warps=warps,
        num_stages=2, **launch_kwargs(pdl))
    return out


def table_slots(table: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """Slots of a row's tokens ``0..n-1`` from its block table ``[max_blocks]``."""
    t = torch.arange(n, device=table.device)
    return table.long()[t // block_size] * block_size + t % block_size


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        kv_slots: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Math attention of one sequence: ``q [n, heads, d]`` at positions ``q_pos [n]`` over the
    keys at ``kv_slots [ctx]`` (token ``j`` of the sequence at slot ``kv_slots[j]``), causal
    (query at position ``p`` sees tokens ``<= p``). Returns ``[n, heads, d]``; softmax in
    float32 like :func:`qwen_trt.fast.kernels.attention.math_attend`."""
    n, heads, d = q.shape
    kvh = k_cache.shape[0]
    group = heads // kvh
    k = k_cache.index_select(1, kv_slots)                           # [kvh, ctx, d]
    v = v_cache.index_select(1, kv_slots)
    qh = q.permute(1, 0, 2).reshape(kvh, group * n, d)              # [kvh, group*n, d]
    s = torch.matmul(qh, k.transpose(1, 2)).float() * d ** -0.5    # [kvh, group*n, ctx]
    s = s.view(kvh, group, n, -1)
    ctx = torch.arange(kv_slots.shape[0], device=q.device)
    s = s.masked_fill(~(ctx[None, :] <= q_pos[:, None]), float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype).view(kvh, group * n, -1)
    o = torch.matmul(p, v).view(heads, n, d)
    return o.permute(1, 0, 2)
