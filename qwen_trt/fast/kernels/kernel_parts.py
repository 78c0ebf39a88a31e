"""Pieces shared by the decode kernels (Triton ``@jit`` helpers, inlined where they are called).

* :func:`norm_rope` -- q/k RMSNorm and rotary embedding of heads held as two halves, rounded
  step by step like the unfused PyTorch ops (``fast/reference.py``); :func:`rope_rows` loads
  the rotary tables' rows;
* :func:`load_kv` -- a tile of keys and values from the cache;
* :func:`rope_group` -- the query heads of one kv head from a ``qkv`` row, normed and rotated,
  as one ``[GROUP_PAD, D]`` tile ready for ``tl.dot``;
* :func:`write_new_kv` -- the new token's key (normed, rotated) and value into the cache, and
  the same row patched into a tile preloaded before the write;
* :func:`softmax_step` -- one tile of flash-decoding's online softmax; :func:`store_partial`
  writes a split's result for the merge, :func:`merge_splits` merges them; :func:`block_slots`
  looks a block up in a table;
* :func:`silu_mul` -- the gate/up projections' ``silu(gate) * up`` epilogue, rounded like
  PyTorch (the GEMVs of ``fast/gemv.py`` and the small-batch GEMM of ``fast/bgemm.py``);
  :func:`store_rows` -- a GEMV's whole epilogue (``fast/gemv.py``, ``qkernels_fp8.py``,
  ``qkernels_int4.py``, ``qkernels_gemm.py``).
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs: nothing here is launched
    triton = None


if triton is not None:
    @triton.jit
    def silu_mul(gate, up, dt: tl.constexpr):
        """``silu(gate) * up`` of two projections already rounded to ``dt``, each op rounded
        to ``dt`` as the unfused PyTorch ops do."""
        gf = gate.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(dt)
        return (act.to(tl.float32) * up.to(tl.float32)).to(dt)

    @triton.jit
    def store_rows(y_acc, u_acc, rows, row_ok, res_ptr, out_ptr, dt: tl.constexpr,
                   GATE_UP: tl.constexpr, RESIDUAL: tl.constexpr):
        """A GEMV's epilogue: float32 row sums ``y_acc`` (and the up rows' ``u_acc``) ->
        rounded to ``dt``, ``silu(gate) * up`` and the residual add each rounded like PyTorch,
        stored."""
        y = y_acc.to(dt)
        if GATE_UP:
            y = silu_mul(y, u_acc.to(dt), dt)
        if RESIDUAL:
            r = tl.load(res_ptr + rows, mask=row_ok, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dt)
        tl.store(out_ptr + rows, y, mask=row_ok)

    @triton.jit
    def norm_rope(x1, x2, g1, g2, c1, c2, s1, s2, eps, D: tl.constexpr, AXIS: tl.constexpr,
                  dt: tl.constexpr):
        """float32 halves ``x1, x2`` of heads (reduced along ``AXIS``), norm weights ``g``
        and rotary rows ``c, s`` (float32) -> the rotated halves in float32, each op rounded
        to ``dt`` as PyTorch does: ``rms_norm`` then ``x * cos + rotate_half(x) * sin``."""
        rstd = tl.rsqrt((tl.sum(x1 * x1, AXIS, keep_dims=True)
                         + tl.sum(x2 * x2, AXIS, keep_dims=True)) / D + eps)
        n1 = (g1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        n2 = (g2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        o1 = (n1 * c1).to(dt).to(tl.float32) + (-n2 * s1).to(dt).to(tl.float32)
        o2 = (n2 * c2).to(dt).to(tl.float32) + (n1 * s2).to(dt).to(tl.float32)
        return o1, o2

    @triton.jit
    def rope_rows(cos_ptr, sin_ptr, row, i, half: tl.constexpr):
        """The rotary tables' halves (float32) at offset ``row`` (``pos * D``: a scalar, or a
        column for several positions) and columns ``i`` (``arange(D/2)``, as a row then)."""
        c1 = tl.load(cos_ptr + row + i).to(tl.float32)
        c2 = tl.load(cos_ptr + row + half + i).to(tl.float32)
        s1 = tl.load(sin_ptr + row + i).to(tl.float32)
        s2 = tl.load(sin_ptr + row + half + i).to(tl.float32)
        return c1, c2, s1, s2

    @triton.jit
    def load_kv(k_ptr, v_ptr, kh, slots, ok, dims, stride_kh, stride_ks):
        """Keys and values of kv head ``kh`` at cache ``slots`` (rows where ``ok``; zeros
        elsewhere): two ``[len(slots), D]`` tiles."""
        kv_off = kh * stride_kh + slots[:, None] * stride_ks + dims[None, :]
        k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0)
        return k, v

    @triton.jit
    def store_partial(m_ptr, l_ptr, acc_ptr, part, m_i, l_i, acc, row_ok, dims,
                      D: tl.constexpr):
        """One split's running max, sum and accumulator of its query rows (``part``: their
        indices in the partials, ``row_ok``: the real ones), for the merge kernel."""
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
        tl.store(acc_ptr + part[:, None] * D + dims[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def merge_splits(m_ptr, l_ptr, acc_ptr, base, active, D: tl.constexpr,
                     CHUNK: tl.constexpr):
        """The attention output (float32 ``[D]``) of one query head from the partials of its
        first ``active`` splits at ``base ..``: ``CHUNK`` splits per step,
        only as many steps as ``active`` needs (a graph sized for the longest row reads no
        more for a short one)."""
        dims = tl.arange(0, D)
        m_max = tl.full([CHUNK], float("-inf"), tl.float32)
        c = 0
        while c < active:
            sp = c + tl.arange(0, CHUNK)
            m = tl.load(m_ptr + base + sp, mask=sp < active, other=float("-inf"))
            m_max = tl.maximum(m_max, m)
            c += CHUNK
        top = tl.max(m_max, 0)
        total = tl.zeros([CHUNK], tl.float32)
        acc = tl.zeros([CHUNK, D], tl.float32)
        c = 0
        while c < active:
            sp = c + tl.arange(0, CHUNK)
            ok = sp < active
            m = tl.load(m_ptr + base + sp, mask=ok, other=float("-inf"))
            l_s = tl.load(l_ptr + base + sp, mask=ok, other=0.0)
            a = tl.load(acc_ptr + (base + sp)[:, None] * D + dims[None, :], mask=ok[:, None],
                        other=0.0)
            w = tl.where(ok, tl.exp(m - top), 0.0)
            total += w * l_s
            acc += w[:, None] * a
            c += CHUNK
        return tl.sum(acc, 0) / tl.sum(total, 0)

    @triton.jit
    def block_slots(table_ptr, row, first, n, BS: tl.constexpr):
        """Cache slots of the ``BS`` tokens from ``first`` (a block boundary) of the sequence
        whose block-table row starts at ``row``; tokens from ``n`` on are never read."""
        blk = tl.load(table_ptr + row + first // BS, mask=first < n, other=0).to(tl.int64)
        return blk * BS + tl.arange(0, BS)

    @triton.jit
    def rope_group(src, qn_ptr, first_head, c1, c2, s1, s2, eps, GROUP: tl.constexpr,
                   GROUP_PAD: tl.constexpr, D: tl.constexpr):
        """Query heads ``first_head .. + GROUP`` of the ``qkv`` row at ``src``, normed and
        rotated at the position of the rotary rows ``c, s`` (``[D/2]`` float32 each):
        ``[GROUP_PAD, D]`` in the model dtype, padding rows zero."""
        dt = src.dtype.element_ty
        half: tl.constexpr = D // 2
        i = tl.arange(0, half)
        rows = tl.arange(0, GROUP_PAD)
        row_ok = (rows < GROUP)[:, None]
        qsrc = src + (first_head + rows)[:, None] * D + i[None, :]
        x1 = tl.load(qsrc, mask=row_ok, other=0.0).to(tl.float32)
        x2 = tl.load(qsrc + half, mask=row_ok, other=0.0).to(tl.float32)
        g1 = tl.load(qn_ptr + i).to(tl.float32)[None, :]
        g2 = tl.load(qn_ptr + half + i).to(tl.float32)[None, :]
        q1, q2 = norm_rope(x1, x2, g1, g2, c1[None, :], c2[None, :], s1[None, :], s2[None, :],
                           eps, D, 1, dt)
        return tl.reshape(tl.permute(tl.join(q1.to(dt), q2.to(dt)), (0, 2, 1)), (GROUP_PAD, D))

    @triton.jit
    def write_new_kv(k_src, v_src, kn_ptr, k_dst, v_dst, c1, c2, s1, s2, eps, toks, pos,
                     k_tile, v_tile, D: tl.constexpr, PATCH: tl.constexpr):
        """Key head at ``k_src`` (normed with ``kn_ptr``, rotated by ``c, s``) to ``k_dst``,
        value head at ``v_src`` to ``v_dst``; with ``PATCH`` also into the row of
        ``k_tile``/``v_tile`` (``[len(toks), D]``, loaded before the write) whose token in
        ``toks`` is ``pos``. Returns the two tiles."""
        dt = k_src.dtype.element_ty
        half: tl.constexpr = D // 2
        i = tl.arange(0, half)
        f1 = tl.load(k_src + i).to(tl.float32)
        f2 = tl.load(k_src + half + i).to(tl.float32)
        g1 = tl.load(kn_ptr + i).to(tl.float32)
        g2 = tl.load(kn_ptr + half + i).to(tl.float32)
        k1, k2 = norm_rope(f1, f2, g1, g2, c1, c2, s1, s2, eps, D, 0, dt)
        k1 = k1.to(dt)
        k2 = k2.to(dt)
        v1 = tl.load(v_src + i)
        v2 = tl.load(v_src + half + i)
        tl.store(k_dst + i, k1)
        tl.store(k_dst + half + i, k2)
        tl.store(v_dst + i, v1)
        tl.store(v_dst + half + i, v2)
        if PATCH:
            here = (toks == pos)[:, None]
            k_new = tl.reshape(tl.permute(tl.join(k1, k2), (1, 0)), (D,))
            v_new = tl.reshape(tl.permute(tl.join(v1, v2), (1, 0)), (D,))
            k_tile = tl.where(here, k_new[None, :], k_tile)
            v_tile = tl.where(here, v_new[None, :], v_tile)
        return k_tile, v_tile

    @triton.jit
    def softmax_step(q, k, v, keep, m_i, l_i, acc, scale, IEEE: tl.constexpr,
                     SAFE: tl.constexpr, EXP2: tl.constexpr = False):
        """One tile of keys ``k`` / values ``v`` into the running max ``m_i``, sum ``l_i`` and
        ``acc`` of the queries ``q``; ``keep``: which scores count (broadcast to ``[queries,
        keys]``). ``IEEE``: exact float32 products (``tl.dot`` defaults to tf32); ``SAFE``: rows
        with no key yet keep zeros instead of NaNs; ``EXP2``: ``scale`` includes log2(e)."""
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if SAFE:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        if EXP2:
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
        else:
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc * alpha[:, None] + pv


else:  # pragma: no cover - CPU-only installs import the kernel modules but launch nothing
    norm_rope = rope_rows = load_kv = rope_group = write_new_kv = softmax_step = None
    store_partial = block_slots = merge_splits = silu_mul = store_rows = None
