"""The packed-weight kernels past batch 1 (:mod:`qwen_trt.fast.kernels.qkernels`): the split-K
small-batch GEMM for FP8, INT4 and dense weights (``_mm_kernel``) and the kernel that sums its
partials and finishes the rows (``_mm_finish_kernel``), the prefill's activation quantization
(``_act_quant_kernel``) and dequantization (``_dequant_kernel``)."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


if triton is not None:
    from qwen_trt.fast.kernels.kernel_parts import silu_mul, store_rows
    from qwen_trt.fast.kernels.pdl import gdc_launch_dependents, gdc_wait

    # ---- 2..64 rows: split-K GEMM for every format ---------------------------------------

    @triton.jit
    def _mm_raw(w_ptr, rn, n_ok, t, ok, K: tl.constexpr, SK: tl.constexpr,
                BK: tl.constexpr, FMT: tl.constexpr):
        """Step ``t``'s weights of rows ``rn``: FP8 bytes ``[BLOCK_N, SK]`` (one scale block),
        INT4 words ``[BLOCK_N, SK / 8]`` (one group), dense ``[BLOCK_N, BK]``."""
        if FMT == 0:
            kk = t * SK + tl.arange(0, SK)
            return tl.load(w_ptr + rn[:, None] * K + kk[None, :],
                           mask=n_ok[:, None] & ((kk < K) & ok)[None, :], other=0)
        elif FMT == 1:
            j = t * (SK // 8) + tl.arange(0, SK // 8)
            return tl.load(w_ptr + rn[:, None] * (K // 8) + j[None, :],
                           mask=n_ok[:, None] & ((j < K // 8) & ok)[None, :], other=0)
        else:
            kk = t * BK + tl.arange(0, BK)
            return tl.load(w_ptr + rn[:, None] * K + kk[None, :],
                           mask=n_ok[:, None] & ((kk < K) & ok)[None, :], other=0.0)

    @triton.jit
    def _dot(x, w, IEEE: tl.constexpr):
        """``x [BM, k] @ w[BN, k].T`` in float32."""
        if IEEE:
            return tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            return tl.dot(x, tl.trans(w))

    @triton.jit
    def _mm_step(raw, s_ptr, z_ptr, x_ptr, rm, m_ok, rn, n_ok, t, ok, acc,
                 K: tl.constexpr, KS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                 BK: tl.constexpr, FMT: tl.constexpr, IEEE: tl.constexpr, dt: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr):
        """``acc [BM, BN]`` plus step ``t``'s products (``raw`` from :func:`_mm_raw`)."""
        if FMT == 0:
            kk = t * SK + tl.arange(0, SK)
            x = tl.load(x_ptr + rm[:, None] * K + kk[None, :],
                        mask=m_ok[:, None] & ((kk < K) & ok)[None, :], other=0.0)
            w = raw.to(tl.float8e4nv, bitcast=True).to(dt)      # exact in bf16 / fp32
            s = tl.load(s_ptr + (rn // SN) * KS + t, mask=n_ok & ok, other=0.0)
            acc += _dot(x, w, IEEE) * s[None, :]
        elif FMT == 1:
            W: tl.constexpr = SK // 8
            col = (t * W + tl.arange(0, W)) * 8
            xm = m_ok[:, None] & ((col < K) & ok)[None, :]
            xo = x_ptr + rm[:, None] * K + col[None, :]
            d = tl.zeros([BM, BN], tl.float32)
            xs = tl.zeros([BM], tl.float32)
            for i in tl.static_range(8):
                xi = tl.load(xo + i, mask=xm, other=0.0)
                qi = ((((raw >> (4 * i)) & 15) | 0x4B000000).to(tl.float32, bitcast=True)
                      - 8388608.0)
                if W >= 16:
                    d += _dot(xi, qi.to(dt), IEEE)
                else:    # too narrow for tl.dot (groups < 128 columns: small test models)
                    d += tl.sum(xi.to(tl.float32)[:, None, :] * qi[None, :, :], 2)
                xs += tl.sum(xi.to(tl.float32), 1)
            g = rn * KS + t
            s = tl.load(s_ptr + g, mask=n_ok & ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g, mask=n_ok & ok, other=0).to(tl.float32)
            acc += (d - xs[:, None] * z[None, :]) * s[None, :]
        else:
            kk = t * BK + tl.arange(0, BK)
            x = tl.load(x_ptr + rm[:, None] * K + kk[None, :],
                        mask=m_ok[:, None] & ((kk < K) & ok)[None, :], other=0.0)
            acc += _dot(x, raw, IEEE)
        return acc

    @triton.jit
    def _mm_kernel(w_ptr, s_ptr, z_ptr, x_ptr, out_ptr, part_ptr, res_ptr, M,
                   N: tl.constexpr, K: tl.constexpr, KS: tl.constexpr, SN: tl.constexpr,
                   SK: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   PREFETCH: tl.constexpr, RESIDUAL: tl.constexpr, GATE_UP: tl.constexpr,
                   IEEE: tl.constexpr, PDL: tl.constexpr):
        """Strip ``program_id(0)`` of the output, K share ``program_id(1)`` of ``SPLIT``.
        ``SPLIT > 1``: float32 partials ``[SPLIT, M, N]`` (gate_up: ``[SPLIT, M, 2N]``) for
        :func:`_mm_finish_kernel`; else the finished rows."""
        STEP: tl.constexpr = BK if FMT == 2 else SK
        T: tl.constexpr = (K + STEP - 1) // STEP            # steps along K
        TS: tl.constexpr = (T + SPLIT - 1) // SPLIT         # steps per program
        pid = tl.program_id(0)
        t0 = tl.program_id(1) * TS
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        dt = x_ptr.dtype.element_ty
        if PREFETCH:     # weights are constant: the first step loads before the PDL wait
            first = (tl.zeros([1], tl.int32) + t0) < T    # scalars as [1] masks
            cur = _mm_raw(w_ptr, rn, n_ok, t0, first, K, SK, BK, FMT)
            cur2 = cur
            if GATE_UP:
                cur2 = _mm_raw(w_ptr, rn + N, n_ok, t0, first, K, SK, BK, FMT)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for i in range(TS):
            t = t0 + i
            # the step's validity as a [1] mask (a scalar bool in a tensor mask is an integer
            # to Triton's interpreter)
            at = tl.zeros([1], tl.int32) + t
            ok = at < T
            more = (at - t0 + 1 < TS) & (at + 1 < T)
            if PREFETCH:
                w1 = cur
                cur = _mm_raw(w_ptr, rn, n_ok, t + 1, more, K, SK, BK, FMT)
            else:
                w1 = _mm_raw(w_ptr, rn, n_ok, t, ok, K, SK, BK, FMT)
            acc = _mm_step(w1, s_ptr, z_ptr, x_ptr, rm, m_ok, rn, n_ok, t, ok, acc,
                           K, KS, SN, SK, BK, FMT, IEEE, dt, BLOCK_M, BLOCK_N)
            if GATE_UP:
                if PREFETCH:
                    w2 = cur2
                    cur2 = _mm_raw(w_ptr, rn + N, n_ok, t + 1, more, K, SK, BK, FMT)
                else:
                    w2 = _mm_raw(w_ptr, rn + N, n_ok, t, ok, K, SK, BK, FMT)
                acc2 = _mm_step(w2, s_ptr, z_ptr, x_ptr, rm, m_ok, rn + N, n_ok, t, ok,
                                acc2, K, KS, SN, SK, BK, FMT, IEEE, dt, BLOCK_M, BLOCK_N)
        om = m_ok[:, None] & n_ok[None, :]
        if SPLIT > 1:
            NOUT: tl.constexpr = 2 * N if GATE_UP else N
            po = part_ptr + tl.program_id(1) * M * NOUT + rm[:, None] * NOUT + rn[None, :]
            tl.store(po, acc, mask=om)
            if GATE_UP:
                tl.store(po + N, acc2, mask=om)
        else:
            y = acc.to(dt)
            if GATE_UP:
                y = silu_mul(y, acc2.to(dt), dt)
            offs = rm[:, None] * N + rn[None, :]
            if RESIDUAL:
                r = tl.load(res_ptr + offs, mask=om, other=0.0)
                y = (r.to(tl.float32) + y.to(tl.float32)).to(dt)
            tl.store(out_ptr + offs, y, mask=om)

    @triton.jit
    def _mm_finish_kernel(part_ptr, out_ptr, res_ptr, M, N: tl.constexpr,
                          SPLIT: tl.constexpr, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
                          GATE_UP: tl.constexpr, PDL: tl.constexpr):
        """``out [M, N]`` from the split partials: summed, rounded, the epilogue."""
        NOUT: tl.constexpr = 2 * N if GATE_UP else N
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = idx < M * N
        m = idx // N
        n = idx % N
        dt = out_ptr.dtype.element_ty
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        y = tl.zeros([BLOCK], tl.float32)
        u = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(SPLIT):
            y += tl.load(part_ptr + s * M * NOUT + m * NOUT + n, mask=ok, other=0.0)
            if GATE_UP:
                u += tl.load(part_ptr + s * M * NOUT + m * NOUT + N + n, mask=ok, other=0.0)
        store_rows(y, u, idx, ok, res_ptr, out_ptr, dt, GATE_UP, RESIDUAL)

    # ---- dequantize (prefill) ------------------------------------------------------------

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K: tl.constexpr, G: tl.constexpr,
                          BLOCK_M: tl.constexpr):
        """:func:`~qwen_trt.fast.model.qformats.fp8_act_quant` for ``BLOCK_M`` rows and one group of
        ``G`` columns: float8_e4m3fn values, and the float32 scale of each row's group written
        outer-dimension-major (``[K / G, M]``: the layout ``torch._scaled_mm`` takes)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        g = tl.program_id(1)
        cols = g * G + tl.arange(0, G)
        ok = (rows < M)[:, None]
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=ok, other=0.0).to(
            tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-12) / 448.0
        q = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
        tl.store(q_ptr + rows[:, None] * K + cols[None, :],
                 q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=ok)
        tl.store(s_ptr + g * M + rows, scale, mask=rows < M)

    @triton.jit
    def _dequant_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr,
                        KS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                        BLOCK_N: tl.constexpr, FMT: tl.constexpr):
        """Rows ``program_id(0)``, scale block / group ``program_id(1)`` in the model dtype."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        t = tl.program_id(1)
        kk = t * SK + tl.arange(0, SK)
        m = row_ok[:, None] & (kk < K)[None, :]
        if FMT == 0:
            raw = tl.load(q_ptr + rows[:, None] * K + kk[None, :], mask=m, other=0)
            s = tl.load(s_ptr + (rows // SN) * KS + t, mask=row_ok, other=0.0)
            w = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, None]
        else:   # the group's words as [rows, words, 8 nibbles], flattened to its columns
            j = t * (SK // 8) + tl.arange(0, SK // 8)
            wq = tl.load(q_ptr + rows[:, None] * (K // 8) + j[None, :],
                         mask=row_ok[:, None] & (j < K // 8)[None, :], other=0)
            q = ((wq[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 15).to(tl.float32)
            s = tl.load(s_ptr + rows * KS + t, mask=row_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + rows * KS + t, mask=row_ok, other=0).to(tl.float32)
            w = tl.reshape(q * s[:, None, None] - (z * s)[:, None, None], (BLOCK_N, SK))
        tl.store(out_ptr + rows[:, None] * K + kk[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=m)
