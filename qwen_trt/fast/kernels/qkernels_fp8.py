"""The batch-1 FP8 GEMV kernels (128x128 block scales) of ``qkernels.qgemv``:
the plain form (bytes, or with ``asm`` int32 words converted in place, or with ``half`` int64
words and f16x2 products: ``_fp8_gemv_kernel``) and the folded one, the block scales folded
into the activations (``_f8w_gemv_kernel``; ``probe``: the sweep's memory-stream diagnostic)."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


if triton is not None:
    from qwen_trt.fast.kernels.kernel_parts import store_rows
    from qwen_trt.fast.kernels.pdl import gdc_launch_dependents, gdc_wait
    from qwen_trt.fast.kernels.qkernel_parts import (_f16_pair, _h16, _half_scale, _norm_x,
                                                     _x8, _x_rstd)

    # four float8_e4m3fn bytes of one 32-bit register (byte i = element i) -> four float32
    _FP8X4_TO_F32 = tl.constexpr("""{
.reg .b16 lo, hi;
.reg .b32 h0, h1;
.reg .f16 e0, e1, e2, e3;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 h0, lo;
cvt.rn.f16x2.e4m3x2 h1, hi;
mov.b32 {e0, e1}, h0;
mov.b32 {e2, e3}, h1;
cvt.f32.f16 $0, e0;
cvt.f32.f16 $1, e1;
cvt.f32.f16 $2, e2;
cvt.f32.f16 $3, e3;
}""")
    # one int64 word of eight float8_e4m3fn bytes times eight activations held as four f16x2
    # pairs ($2..$5: bytes 2i, 2i + 1) -> one float32: four cvt.rn.f16x2.e4m3x2 (exact), the
    # products summed in f16x2 (four a lane: bytes 0, 2, 4, 6 and 1, 3, 5, 7), the two lanes
    # converted and added in float32 (QConfig.half)
    _FP8X8_DOT_F16 = tl.constexpr("""{
.reg .b32 w0, w1, h0, h1, h2, h3, acc;
.reg .b16 l0, l1, l2, l3;
.reg .f16 e0, e1;
.reg .f32 f0, f1;
mov.b64 {w0, w1}, $1;
mov.b32 {l0, l1}, w0;
mov.b32 {l2, l3}, w1;
cvt.rn.f16x2.e4m3x2 h0, l0;
cvt.rn.f16x2.e4m3x2 h1, l1;
cvt.rn.f16x2.e4m3x2 h2, l2;
cvt.rn.f16x2.e4m3x2 h3, l3;
mul.rn.f16x2 acc, h0, $2;
fma.rn.f16x2 acc, h1, $3, acc;
fma.rn.f16x2 acc, h2, $4, acc;
fma.rn.f16x2 acc, h3, $5, acc;
mov.b32 {e0, e1}, acc;
cvt.f32.f16 f0, e0;
cvt.f32.f16 f1, e1;
add.f32 $0, f0, f1;
}""")

    # ---- batch 1: FP8 ------------------------------------------------------------------

    @triton.jit
    def _fp8_raw(q_ptr, rows, row_ok, B0: tl.constexpr, NB: tl.constexpr, K: tl.constexpr,
                 SK: tl.constexpr, EVICT: tl.constexpr, WORDS: tl.constexpr = False,
                 HALF: tl.constexpr = False):
        """The bytes ``[BLOCK_N, NB, SK]`` of ``rows`` in scale blocks ``B0 .. B0 + NB``
        (``WORDS``: as int32 words ``[BLOCK_N, NB, SK / 4]``, byte ``i`` of word ``c`` being
        column ``4c + i``; ``HALF``: int64 words ``[BLOCK_N, NB, SK / 8]``, two a thread)."""
        if HALF:
            j = (B0 + tl.arange(0, NB))[:, None] * (SK // 8) + tl.arange(0, SK // 8)[None, :]
            m = row_ok[:, None, None] & (j < K // 8)[None, :, :]
            q64 = q_ptr.to(tl.pointer_type(tl.int64))
            offs = tl.max_contiguous(tl.multiple_of(rows[:, None, None] * (K // 8)
                                                    + j[None, :, :], [1, 1, 2]), [1, 1, 2])
            out = tl.load(q64 + offs, mask=m, other=0, eviction_policy=EVICT)
        elif WORDS:
            j = (B0 + tl.arange(0, NB))[:, None] * (SK // 4) + tl.arange(0, SK // 4)[None, :]
            m = row_ok[:, None, None] & (j < K // 4)[None, :, :]
            q32 = q_ptr.to(tl.pointer_type(tl.int32))
            out = tl.load(q32 + rows[:, None, None] * (K // 4) + j[None, :, :], mask=m,
                          other=0, eviction_policy=EVICT)
        else:
            kk = (B0 + tl.arange(0, NB))[:, None] * SK + tl.arange(0, SK)[None, :]
            m = row_ok[:, None, None] & (kk < K)[None, :, :]
            # 8-byte loads: the activations' bf16 tiles load 8 to a thread too, so the
            # products are formed in the weights' own register layout (16-byte loads made
            # Triton convert every weight tile to the activations' layout through shared
            # memory)
            offs = tl.max_contiguous(rows[:, None, None] * K + kk[None, :, :], [1, 1, 8])
            out = tl.load(q_ptr + offs, mask=m, other=0, eviction_policy=EVICT)
        return out

    @triton.jit
    def _fp8_scales(s_ptr, rows, row_ok, B0: tl.constexpr, NB: tl.constexpr,
                    KS: tl.constexpr, SN: tl.constexpr):
        """The scales ``[BLOCK_N, NB]`` of ``rows`` in blocks ``B0 .. B0 + NB``."""
        b = B0 + tl.arange(0, NB)
        return tl.load(s_ptr + (rows // SN)[:, None] * KS + b[None, :],
                       mask=row_ok[:, None] & (b < KS)[None, :], other=0.0)

    @triton.jit
    def _byte(w, i: tl.constexpr):
        """Byte ``i`` of int32 words as float8_e4m3fn -> float32."""
        return ((w >> (8 * i)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(
            tl.float32)

    @triton.jit
    def _b16(w, i: tl.constexpr):
        """Byte ``i`` of int64 words as float8_e4m3fn -> float16 (exact)."""
        return ((w >> (8 * i)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(
            tl.float16)

    @triton.jit
    def _fp8_half_dot(raw, xa, xb, xc, xd, ASM: tl.constexpr):
        """Per int64 word of ``raw`` (eight bytes): the sum of its eight products with the
        activations ``xa .. xd`` (f16x2 pairs of bytes 0-1 .. 6-7), formed and summed in
        float16 four to a lane, the two lanes added in float32 (``_FP8X8_DOT_F16``; here
        the same sums in Triton ops)."""
        if ASM:
            return tl.inline_asm_elementwise(_FP8X8_DOT_F16, "=r,l,r,r,r,r",
                                             [raw, xa, xb, xc, xd], dtype=tl.float32,
                                             is_pure=True, pack=1)
        lo = (_b16(raw, 0) * _h16(xa, False) + _b16(raw, 2) * _h16(xb, False)
              + _b16(raw, 4) * _h16(xc, False) + _b16(raw, 6) * _h16(xd, False))
        hi = (_b16(raw, 1) * _h16(xa, True) + _b16(raw, 3) * _h16(xb, True)
              + _b16(raw, 5) * _h16(xc, True) + _b16(raw, 7) * _h16(xd, True))
        return lo.to(tl.float32) + hi.to(tl.float32)

    @triton.jit
    def _fp8_dot(raw, sc, xa, xb, xc, xd, WORDS: tl.constexpr = False,
                 ASM: tl.constexpr = False, HALF: tl.constexpr = False):
        """Row sums of ``raw`` times the activations, reduced per block, then scaled: bytes
        times ``xa [NB, SK]``, or (``WORDS``) words times ``xa .. xd [NB, SK / 4]``, the
        activations of byte positions 0..3. ``ASM``: a word's four bytes convert in the
        register they were loaded into (two ``cvt.rn.f16x2.e4m3x2``, four ``cvt.f32.f16``);
        Triton's own conversion first splits the bytes into a register each and packs them
        back in pairs (about two instructions per weight more, in the SASS for sm_90).
        ``HALF``: int64 words times f16x2 activation pairs (:func:`_fp8_half_dot`)."""
        if HALF:
            prod = _fp8_half_dot(raw, xa, xb, xc, xd, ASM)
        elif WORDS:
            if ASM:
                b0, b1, b2, b3 = tl.inline_asm_elementwise(
                    _FP8X4_TO_F32, "=r,=r,=r,=r,r", [raw],
                    dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
                    pack=1)
            else:
                b0, b1, b2, b3 = _byte(raw, 0), _byte(raw, 1), _byte(raw, 2), _byte(raw, 3)
            prod = (b0 * xa[None, :, :] + b1 * xb[None, :, :] + b2 * xc[None, :, :]
                    + b3 * xd[None, :, :])
        else:
            prod = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * xa[None, :, :]
        return tl.sum(tl.sum(prod, 2) * sc, 1)

    @triton.jit
    def _fp8_x(x_ptr, ln_ptr, B0: tl.constexpr, NB: tl.constexpr, SK: tl.constexpr,
               K: tl.constexpr, rstd, dt: tl.constexpr, NORM: tl.constexpr,
               WORDS: tl.constexpr, HALF: tl.constexpr = False, scale=1.0):
        """The activations of blocks ``B0 .. B0 + NB`` for :func:`_fp8_dot`: one
        ``[NB, SK]`` tile (repeated), or (``WORDS``) one ``[NB, SK / 4]`` tile per byte
        position, or (``HALF``) four ``[NB, SK / 8]`` int32 tiles, the f16x2 pairs of byte
        positions 0-1, 2-3, 4-5, 6-7 times ``scale`` (a power of two)."""
        if HALF:
            col = ((B0 + tl.arange(0, NB))[:, None] * (SK // 8)
                   + tl.arange(0, SK // 8)[None, :]) * 8
            x0, x1, x2, x3, x4, x5, x6, x7 = _x8(x_ptr, ln_ptr, col, col < K, rstd, dt, NORM)
            xa = _f16_pair(x0 * scale, x1 * scale)
            xb = _f16_pair(x2 * scale, x3 * scale)
            xc = _f16_pair(x4 * scale, x5 * scale)
            xd = _f16_pair(x6 * scale, x7 * scale)
        elif WORDS:
            col = ((B0 + tl.arange(0, NB))[:, None] * (SK // 4)
                   + tl.arange(0, SK // 4)[None, :]) * 4
            ok = col < K
            xa = _norm_x(x_ptr, ln_ptr, col, ok, rstd, dt, NORM)
            xb = _norm_x(x_ptr, ln_ptr, col + 1, ok, rstd, dt, NORM)
            xc = _norm_x(x_ptr, ln_ptr, col + 2, ok, rstd, dt, NORM)
            xd = _norm_x(x_ptr, ln_ptr, col + 3, ok, rstd, dt, NORM)
        else:
            kk = B0 * SK + tl.arange(0, NB)[:, None] * SK + tl.arange(0, SK)[None, :]
            xa = _norm_x(x_ptr, ln_ptr, kk, kk < K, rstd, dt, NORM)
            xb, xc, xd = xa, xa, xa
        return xa, xb, xc, xd

    @triton.jit
    def _fp8_block(q_ptr, s_ptr, rows, ok, N: tl.constexpr, K: tl.constexpr,
                   KS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr, NB0: tl.constexpr,
                   NB1: tl.constexpr, TWO: tl.constexpr, GATE_UP: tl.constexpr,
                   EVICT: tl.constexpr, WORDS: tl.constexpr, HALF: tl.constexpr = False):
        """One row block's weights and scales: both pieces (``TWO``), gate and up rows
        (``GATE_UP``); what a form lacks is a copy of what it has."""
        a0 = _fp8_raw(q_ptr, rows, ok, 0, NB0, K, SK, EVICT, WORDS, HALF)
        sa0 = _fp8_scales(s_ptr, rows, ok, 0, NB0, KS, SN)
        a1, sa1 = a0, sa0
        if TWO:
            a1 = _fp8_raw(q_ptr, rows, ok, NB0, NB1, K, SK, EVICT, WORDS, HALF)
            sa1 = _fp8_scales(s_ptr, rows, ok, NB0, NB1, KS, SN)
        g0, g1, sg0, sg1 = a0, a1, sa0, sa1
        if GATE_UP:
            g0 = _fp8_raw(q_ptr, rows + N, ok, 0, NB0, K, SK, EVICT, WORDS, HALF)
            sg0 = _fp8_scales(s_ptr, rows + N, ok, 0, NB0, KS, SN)
            g1, sg1 = g0, sg0
            if TWO:
                g1 = _fp8_raw(q_ptr, rows + N, ok, NB0, NB1, K, SK, EVICT, WORDS, HALF)
                sg1 = _fp8_scales(s_ptr, rows + N, ok, NB0, NB1, KS, SN)
        return a0, a1, sa0, sa1, g0, g1, sg0, sg1

    @triton.jit
    def _fp8_sums(a0, a1, sa0, sa1, g0, g1, sg0, sg1, x0a, x0b, x0c, x0d, x1a, x1b, x1c,
                  x1d, TWO: tl.constexpr, GATE_UP: tl.constexpr, WORDS: tl.constexpr,
                  ASM: tl.constexpr, HALF: tl.constexpr = False):
        """Row sums ``(y, u)`` of one row block (``u``: the up rows, with ``GATE_UP``)."""
        y = _fp8_dot(a0, sa0, x0a, x0b, x0c, x0d, WORDS, ASM, HALF)
        if TWO:
            y += _fp8_dot(a1, sa1, x1a, x1b, x1c, x1d, WORDS, ASM, HALF)
        u = y
        if GATE_UP:
            u = _fp8_dot(g0, sg0, x0a, x0b, x0c, x0d, WORDS, ASM, HALF)
            if TWO:
                u += _fp8_dot(g1, sg1, x1a, x1b, x1c, x1d, WORDS, ASM, HALF)
        return y, u

    @triton.jit
    def _fp8_gemv_kernel(q_ptr, s_ptr, x_ptr, out_ptr, ln_ptr, res_ptr, eps,
                         N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, KS: tl.constexpr,
                         SN: tl.constexpr, SK: tl.constexpr, NB0: tl.constexpr,
                         NB1: tl.constexpr, BLOCK_N: tl.constexpr, NORM: tl.constexpr,
                         RESIDUAL: tl.constexpr, GATE_UP: tl.constexpr, PDL: tl.constexpr,
                         P: tl.constexpr, AHEAD: tl.constexpr = 1, EVICT: tl.constexpr = "",
                         WORDS: tl.constexpr = False, ASM: tl.constexpr = False,
                         HALF: tl.constexpr = False):
        """Program ``pid`` reduces row blocks ``pid, pid + P, ...`` with the next ``AHEAD``
        (1 or 2) blocks' loads in flight; a row is a piece of ``NB0`` scale blocks and, where
        that does not cover K, one of ``NB1``. ``WORDS``, ``ASM``, ``HALF``: see
        :func:`_fp8_dot` (``HALF``: the activations scaled by :func:`_half_scale`'s power of
        two, the row sums by its inverse)."""
        TWO: tl.constexpr = NB0 * SK < K
        pid = tl.program_id(0)
        n_blocks: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        iters: tl.constexpr = (n_blocks + P - 1) // P
        dt = x_ptr.dtype.element_ty
        r = tl.arange(0, BLOCK_N)
        rows = pid * BLOCK_N + r
        a0, a1, sa0, sa1, g0, g1, sg0, sg1 = _fp8_block(
            q_ptr, s_ptr, rows, rows < N, N, K, KS, SN, SK, NB0, NB1, TWO, GATE_UP, EVICT,
            WORDS, HALF)
        if AHEAD == 2:
            rows = rows + P * BLOCK_N
            b0, b1, sb0, sb1, h0, h1, sh0, sh1 = _fp8_block(
                q_ptr, s_ptr, rows, rows < N, N, K, KS, SN, SK, NB0, NB1, TWO, GATE_UP, EVICT,
                WORDS, HALF)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        rstd = 0.0
        if NORM:
            rstd = _x_rstd(x_ptr, K, KP, eps)
        p, inv_p = 1.0, 1.0
        if HALF:
            p, inv_p = _half_scale(x_ptr, ln_ptr, K, KP, rstd, dt, NORM)
        x0a, x0b, x0c, x0d = _fp8_x(x_ptr, ln_ptr, 0, NB0, SK, K, rstd, dt, NORM, WORDS, HALF,
                                    p)
        x1a, x1b, x1c, x1d = x0a, x0b, x0c, x0d
        if TWO:
            x1a, x1b, x1c, x1d = _fp8_x(x_ptr, ln_ptr, NB0, NB1, SK, K, rstd, dt, NORM, WORDS,
                                        HALF, p)
        for it in range(iters):
            rows = (pid + it * P) * BLOCK_N + r
            nrows = rows + AHEAD * P * BLOCK_N
            c0, c1, sc0, sc1, e0, e1, se0, se1 = _fp8_block(
                q_ptr, s_ptr, nrows, nrows < N, N, K, KS, SN, SK, NB0, NB1, TWO, GATE_UP,
                EVICT, WORDS, HALF)
            y, u = _fp8_sums(a0, a1, sa0, sa1, g0, g1, sg0, sg1, x0a, x0b, x0c, x0d, x1a, x1b,
                             x1c, x1d, TWO, GATE_UP, WORDS, ASM, HALF)
            if HALF:
                y = y * inv_p
                u = u * inv_p
            store_rows(y, u, rows, rows < N, res_ptr, out_ptr, dt, GATE_UP, RESIDUAL)
            if AHEAD == 2:
                a0, a1, sa0, sa1, g0, g1, sg0, sg1 = b0, b1, sb0, sb1, h0, h1, sh0, sh1
                b0, b1, sb0, sb1, h0, h1, sh0, sh1 = c0, c1, sc0, sc1, e0, e1, se0, se1
            else:
                a0, a1, sa0, sa1, g0, g1, sg0, sg1 = c0, c1, sc0, sc1, e0, e1, se0, se1

    # ---- batch 1: FP8, the scales folded into the activations ---------------------------

    @triton.jit
    def _f8w_raw(q_ptr, rows, row_ok, W0: tl.constexpr, NW: tl.constexpr, K: tl.constexpr,
                 EVICT: tl.constexpr):
        """int32 words ``[BLOCK_N, NW]`` (4 bytes = columns ``4j .. 4j + 3``) from word
        ``W0`` of ``rows``, four words (16 bytes) to a thread."""
        j = W0 + tl.arange(0, NW)
        m = row_ok[:, None] & (j < K // 4)[None, :]
        q32 = q_ptr.to(tl.pointer_type(tl.int32))
        offs = tl.max_contiguous(tl.multiple_of(rows[:, None] * (K // 4) + j[None, :], [1, 4]),
                                 [1, 4])
        return tl.load(q32 + offs, mask=m, other=0, eviction_policy=EVICT)

    @triton.jit
    def _f8w_scale(s_ptr, row0, END: tl.constexpr, W0: tl.constexpr, NW: tl.constexpr,
                   KS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr):
        """The block scales ``[NW]`` of words ``W0 ..`` in the scale row of ``row0`` (every
        row of a row block is in that scale row: ``SN % BLOCK_N == 0``); nothing is read for a
        block at or past row ``END`` (a program's prefetch of the block after its last one
        starts past the end of the matrix, and of the scales)."""
        b = (W0 + tl.arange(0, NW)) // (SK // 4)
        return tl.load(s_ptr + (row0 // SN) * KS + b, mask=(b < KS) & (row0 + 0 * b < END),
                       other=0.0)

    @triton.jit
    def _f8w_block(q_ptr, s_ptr, rows, row0, ok, N: tl.constexpr, K: tl.constexpr,
                   KS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr, NW0: tl.constexpr,
                   NW1: tl.constexpr, TWO: tl.constexpr, GATE_UP: tl.constexpr,
                   EVICT: tl.constexpr):
        """One row block: the words of both pieces, gate and up rows, and their scales."""
        a0 = _f8w_raw(q_ptr, rows, ok, 0, NW0, K, EVICT)
        sa0 = _f8w_scale(s_ptr, row0, N, 0, NW0, KS, SN, SK)
        a1, sa1 = a0, sa0
        if TWO:
            a1 = _f8w_raw(q_ptr, rows, ok, NW0, NW1, K, EVICT)
            sa1 = _f8w_scale(s_ptr, row0, N, NW0, NW1, KS, SN, SK)
        g0, g1, sg0, sg1 = a0, a1, sa0, sa1
        if GATE_UP:
            g0 = _f8w_raw(q_ptr, rows + N, ok, 0, NW0, K, EVICT)
            sg0 = _f8w_scale(s_ptr, row0 + N, 2 * N, 0, NW0, KS, SN, SK)
            g1, sg1 = g0, sg0
            if TWO:
                g1 = _f8w_raw(q_ptr, rows + N, ok, NW0, NW1, K, EVICT)
                sg1 = _f8w_scale(s_ptr, row0 + N, 2 * N, NW0, NW1, KS, SN, SK)
        return a0, a1, sa0, sa1, g0, g1, sg0, sg1

    @triton.jit
    def _f8w_dot(raw, sc, xa, xb, xc, xd, ASM: tl.constexpr, PROBE: tl.constexpr = False):
        """Row sums of words ``raw [BLOCK_N, NW]`` times the activations of byte positions
        0..3 (``xa .. xd [NW]``) scaled by the words' block scales ``sc``: one FMA a weight,
        one reduction a row (no per-block sums). ``PROBE``: see ``QConfig.probe``."""
        if PROBE:
            return tl.sum(raw.to(tl.float32, bitcast=True) * (xa * sc)[None, :], 1)
        if ASM:
            b0, b1, b2, b3 = tl.inline_asm_elementwise(
                _FP8X4_TO_F32, "=r,=r,=r,=r,r", [raw],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            b0, b1, b2, b3 = _byte(raw, 0), _byte(raw, 1), _byte(raw, 2), _byte(raw, 3)
        acc = b0 * (xa * sc)[None, :]
        acc += b1 * (xb * sc)[None, :]
        acc += b2 * (xc * sc)[None, :]
        acc += b3 * (xd * sc)[None, :]
        return tl.sum(acc, 1)

    @triton.jit
    def _f8w_x(x_ptr, ln_ptr, W0: tl.constexpr, NW: tl.constexpr, K: tl.constexpr, rstd,
               dt: tl.constexpr, NORM: tl.constexpr):
        """The activations ``[NW]`` of byte positions 0..3 of words ``W0 ..``."""
        col = (W0 + tl.arange(0, NW)) * 4
        ok = col < K
        xa = _norm_x(x_ptr, ln_ptr, col, ok, rstd, dt, NORM)
        xb = _norm_x(x_ptr, ln_ptr, col + 1, ok, rstd, dt, NORM)
        xc = _norm_x(x_ptr, ln_ptr, col + 2, ok, rstd, dt, NORM)
        xd = _norm_x(x_ptr, ln_ptr, col + 3, ok, rstd, dt, NORM)
        return xa, xb, xc, xd

    @triton.jit
    def _f8w_gemv_kernel(q_ptr, s_ptr, x_ptr, out_ptr, ln_ptr, res_ptr, eps,
                         N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, KS: tl.constexpr,
                         SN: tl.constexpr, SK: tl.constexpr, NW0: tl.constexpr,
                         NW1: tl.constexpr, BLOCK_N: tl.constexpr, NORM: tl.constexpr,
                         RESIDUAL: tl.constexpr, GATE_UP: tl.constexpr, PDL: tl.constexpr,
                         P: tl.constexpr, AHEAD: tl.constexpr = 1, EVICT: tl.constexpr = "",
                         ASM: tl.constexpr = False, PROBE: tl.constexpr = False):
        """:func:`_fp8_gemv_kernel` with int32 word loads and each row block's scales folded
        into the activations (``x * s`` per word, once per row block, shared by its rows):
        a row is one piece of ``NW0`` words and, where that does not cover K, one of
        ``NW1``. Needs ``K % 16 == 0``, ``SN % BLOCK_N == 0`` and, with ``GATE_UP``,
        ``N % BLOCK_N == 0``."""
        TWO: tl.constexpr = NW0 * 4 < K
        pid = tl.program_id(0)
        n_blocks: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        iters: tl.constexpr = (n_blocks + P - 1) // P
        dt = x_ptr.dtype.element_ty
        r = tl.arange(0, BLOCK_N)
        row0 = pid * BLOCK_N
        rows = row0 + r
        a0, a1, sa0, sa1, g0, g1, sg0, sg1 = _f8w_block(
            q_ptr, s_ptr, rows, row0, rows < N, N, K, KS, SN, SK, NW0, NW1, TWO, GATE_UP,
            EVICT)
        if AHEAD == 2:
            row0 = row0 + P * BLOCK_N
            rows = row0 + r
            b0, b1, sb0, sb1, h0, h1, sh0, sh1 = _f8w_block(
                q_ptr, s_ptr, rows, row0, rows < N, N, K, KS, SN, SK, NW0, NW1, TWO,
                GATE_UP, EVICT)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        rstd = 0.0
        if NORM:
            rstd = _x_rstd(x_ptr, K, KP, eps)
        x0a, x0b, x0c, x0d = _f8w_x(x_ptr, ln_ptr, 0, NW0, K, rstd, dt, NORM)
        x1a, x1b, x1c, x1d = x0a, x0b, x0c, x0d
        if TWO:
            x1a, x1b, x1c, x1d = _f8w_x(x_ptr, ln_ptr, NW0, NW1, K, rstd, dt, NORM)
        for it in range(iters):
            rows = (pid + it * P) * BLOCK_N + r
            nrow0 = (pid + it * P + AHEAD * P) * BLOCK_N
            nrows = nrow0 + r
            c0, c1, sc0, sc1, e0, e1, se0, se1 = _f8w_block(
                q_ptr, s_ptr, nrows, nrow0, nrows < N, N, K, KS, SN, SK, NW0, NW1, TWO,
                GATE_UP, EVICT)
            y = _f8w_dot(a0, sa0, x0a, x0b, x0c, x0d, ASM, PROBE)
            if TWO:
                y += _f8w_dot(a1, sa1, x1a, x1b, x1c, x1d, ASM, PROBE)
            u = y
            if GATE_UP:
                u = _f8w_dot(g0, sg0, x0a, x0b, x0c, x0d, ASM, PROBE)
                if TWO:
                    u += _f8w_dot(g1, sg1, x1a, x1b, x1c, x1d, ASM, PROBE)
            store_rows(y, u, rows, rows < N, res_ptr, out_ptr, dt, GATE_UP, RESIDUAL)
            if AHEAD == 2:
                a0, a1, sa0, sa1, g0, g1, sg0, sg1 = b0, b1, sb0, sb1, h0, h1, sh0, sh1
                b0, b1, sb0, sb1, h0, h1, sh0, sh1 = c0, c1, sc0, sc1, e0, e1, se0, se1
            else:
                a0, a1, sa0, sa1, g0, g1, sg0, sg1 = c0, c1, sc0, sc1, e0, e1, se0, se1
