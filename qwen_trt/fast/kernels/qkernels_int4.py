"""The batch-1 INT4 GEMV kernel (group scales and zero points, 8 nibbles to an int32 word) of
:func:`qwen_trt.fast.kernels.qkernels.qgemv`: nibbles to floats through the bits of ``2**23``
(``asm``: one ``lop3`` a nibble), or with ``half`` int64 pairs of words and f16x2 products
(two nibbles a ``lop3`` into 1024.0); ``probe``: the sweep's memory-stream diagnostic."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def _i4_word_ptx(word: str, xs: tuple[str, str, str, str], first: bool) -> str:
    """PTX of one int32 word's eight nibbles into the f16x2 accumulator ``acc`` (for
    ``_I4X16_DOT_F16``): nibble pairs (0, 4) and (1, 5) of ``word``, then (2, 6) and (3, 7)
    of ``word >> 8``, each pair OR-ed into 1024.0 by one lop3, less the zero points ($10 for
    the plain pairs, $11 for the 16-times ones), times the activation pairs ``xs``; ``first``:
    the first product starts the sum."""
    lines = [f"shr.u32 u, {word}, 8;"]
    regs = (("t0", word, "0x000F000F", "$10"), ("t1", word, "0x00F000F0", "$11"),
            ("t2", "u", "0x000F000F", "$10"), ("t3", "u", "0x00F000F0", "$11"))
    lines += [f"lop3.b32 {t}, {src}, {mask}, 0x64006400, 0xEA;" for t, src, mask, _ in regs]
    lines += [f"sub.rn.f16x2 {t}, {t}, {z};" for t, _, _, z in regs]
    lines += [(f"mul.rn.f16x2 acc, {t}, {x};" if first and i == 0
               else f"fma.rn.f16x2 acc, {t}, {x}, acc;")
              for i, ((t, _, _, _), x) in enumerate(zip(regs, xs))]
    return "\n".join(lines) + "\n"


if triton is not None:
    from qwen_trt.fast.kernels.kernel_parts import store_rows
    from qwen_trt.fast.kernels.pdl import gdc_launch_dependents, gdc_wait
    from qwen_trt.fast.kernels.qkernel_parts import (_f16_pair, _h16, _half_scale, _x8,
                                                     _x_rstd)

    # one int32 word of eight nibbles -> eight float32 q * 16**(i % 4): nibble i masked in
    # place (in the high half for i >= 4) and OR-ed into 2**23 by one lop3, minus 2**23
    _I4X8_TO_F32 = tl.constexpr("""{
.reg .b32 hi, t;
shr.u32 hi, $8, 16;
lop3.b32 t, $8, 0xF, 0x4B000000, 0xEA;
sub.f32 $0, t, 0f4B000000;
lop3.b32 t, $8, 0xF0, 0x4B000000, 0xEA;
sub.f32 $1, t, 0f4B000000;
lop3.b32 t, $8, 0xF00, 0x4B000000, 0xEA;
sub.f32 $2, t, 0f4B000000;
lop3.b32 t, $8, 0xF000, 0x4B000000, 0xEA;
sub.f32 $3, t, 0f4B000000;
lop3.b32 t, hi, 0xF, 0x4B000000, 0xEA;
sub.f32 $4, t, 0f4B000000;
lop3.b32 t, hi, 0xF0, 0x4B000000, 0xEA;
sub.f32 $5, t, 0f4B000000;
lop3.b32 t, hi, 0xF00, 0x4B000000, 0xEA;
sub.f32 $6, t, 0f4B000000;
lop3.b32 t, hi, 0xF000, 0x4B000000, 0xEA;
sub.f32 $7, t, 0f4B000000;
}""")

    # two int32 words (an int64) of eight nibbles each (column 8c + i in bits 4i) times their
    # activations as f16x2 pairs ($2..$5 the even word's, $6..$9 the odd one's: columns
    # (0, 4), (1, 5) / 16, (2, 6), (3, 7) / 16): each pair of nibbles OR-ed into 1024.0
    # (0x6400) by one lop3 (the odd ones 16 times too large, hence the activations / 16), less
    # 1024 + z ($10) and 1024 + 16 z ($11): q - z and 16 (q - z), exact; eight products a
    # lane formed and summed in f16x2, the lanes added in float32 (QConfig.half for INT4)
    _I4X16_DOT_F16 = tl.constexpr(
        "{\n.reg .b32 w0, w1, u, t0, t1, t2, t3, acc;\n.reg .f16 e0, e1;\n.reg .f32 f0, f1;\n"
        "mov.b64 {w0, w1}, $1;\n" + _i4_word_ptx("w0", ("$2", "$3", "$4", "$5"), True)
        + _i4_word_ptx("w1", ("$6", "$7", "$8", "$9"), False)
        + "mov.b32 {e0, e1}, acc;\ncvt.f32.f16 f0, e0;\ncvt.f32.f16 f1, e1;\n"
        "add.f32 $0, f0, f1;\n}")

    # ---- batch 1: INT4 -----------------------------------------------------------------

    @triton.jit
    def _i4_raw(q_ptr, rows, row_ok, G0: tl.constexpr, NG: tl.constexpr, K: tl.constexpr,
                W: tl.constexpr, EVICT: tl.constexpr, HALF: tl.constexpr = False):
        """The words ``[BLOCK_N, NG, W]`` of ``rows`` in groups ``G0 .. G0 + NG`` (``HALF``:
        as int64 pairs of words ``[BLOCK_N, NG, W / 2]``)."""
        if HALF:
            j = (G0 + tl.arange(0, NG))[:, None] * (W // 2) + tl.arange(0, W // 2)[None, :]
            m = row_ok[:, None, None] & (j < K // 16)[None, :, :]
            q64 = q_ptr.to(tl.pointer_type(tl.int64))
            offs = tl.max_contiguous(tl.multiple_of(rows[:, None, None] * (K // 16)
                                                    + j[None, :, :], [1, 1, 2]), [1, 1, 2])
            out = tl.load(q64 + offs, mask=m, other=0, eviction_policy=EVICT)
        else:
            j = (G0 + tl.arange(0, NG))[:, None] * W + tl.arange(0, W)[None, :]
            m = row_ok[:, None, None] & (j < K // 8)[None, :, :]
            out = tl.load(q_ptr + rows[:, None, None] * (K // 8) + j[None, :, :], mask=m,
                          other=0, eviction_policy=EVICT)
        return out

    @triton.jit
    def _i4_sz(s_ptr, z_ptr, rows, row_ok, G0: tl.constexpr, NG: tl.constexpr,
               KS: tl.constexpr):
        """Scales and zero points ``[BLOCK_N, NG]`` (float32) of ``rows``."""
        g = G0 + tl.arange(0, NG)
        off = rows[:, None] * KS + g[None, :]
        m = row_ok[:, None] & (g < KS)[None, :]
        s = tl.load(s_ptr + off, mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + off, mask=m, other=0).to(tl.float32)
        return s, z

    @triton.jit
    def _nib(w, MASK: tl.constexpr):
        """The nibble under ``MASK`` (bits ``4j .. 4j + 3``, j < 4) as the float ``q * 16**j``."""
        return ((w & MASK) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _i4_x(x_ptr, ln_ptr, G0: tl.constexpr, NG: tl.constexpr, W: tl.constexpr,
              K: tl.constexpr, rstd, dt: tl.constexpr, NORM: tl.constexpr,
              HALF: tl.constexpr = False, scale=1.0):
        """The activations of groups ``G0 .. G0 + NG`` as eight ``[NG, W]`` tiles, one per
        nibble position ``i`` (column ``8c + i`` of the group), pre-scaled by
        ``16 ** -(i % 4)``, and their sums per group ``[NG]``."""
        if HALF:
            out = _i4h_x(x_ptr, ln_ptr, G0, NG, W, K, rstd, dt, NORM, scale)
        else:
            out = _i4_xf(x_ptr, ln_ptr, G0, NG, W, K, rstd, dt, NORM)
        return out

    @triton.jit
    def _i4h_x(x_ptr, ln_ptr, G0: tl.constexpr, NG: tl.constexpr, W: tl.constexpr,
               K: tl.constexpr, rstd, dt: tl.constexpr, NORM: tl.constexpr, scale):
        """:func:`_i4_x` with ``HALF``: per int64 pair of words (16 columns ``16c + i``) the
        f16x2 activation pairs of ``_I4X16_DOT_F16`` for the even word and the odd one (columns
        (i, i + 4), the odd i / 16), times ``scale``, and the unscaled sums per group."""
        col = ((G0 + tl.arange(0, NG))[:, None] * (W // 2)
               + tl.arange(0, W // 2)[None, :]) * 16
        ok = col < K
        sc = scale * 0.0625
        x0, x1, x2, x3, x4, x5, x6, x7 = _x8(x_ptr, ln_ptr, col, ok, rstd, dt, NORM)
        y0, y1, y2, y3, y4, y5, y6, y7 = _x8(x_ptr, ln_ptr, col + 8, ok, rstd, dt, NORM)
        xsum = tl.sum((((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)))
                      + (((y0 + y1) + (y2 + y3)) + ((y4 + y5) + (y6 + y7))), 1)
        return (_f16_pair(x0 * scale, x4 * scale), _f16_pair(x1 * sc, x5 * sc),
                _f16_pair(x2 * scale, x6 * scale), _f16_pair(x3 * sc, x7 * sc),
                _f16_pair(y0 * scale, y4 * scale), _f16_pair(y1 * sc, y5 * sc),
                _f16_pair(y2 * scale, y6 * scale), _f16_pair(y3 * sc, y7 * sc), xsum)

    @triton.jit
    def _i4_xf(x_ptr, ln_ptr, G0: tl.constexpr, NG: tl.constexpr, W: tl.constexpr,
               K: tl.constexpr, rstd, dt: tl.constexpr, NORM: tl.constexpr):
        """:func:`_i4_x` without ``HALF``."""
        col = ((G0 + tl.arange(0, NG))[:, None] * W + tl.arange(0, W)[None, :]) * 8
        x0, x1, x2, x3, x4, x5, x6, x7 = _x8(x_ptr, ln_ptr, col, col < K, rstd, dt, NORM)
        xsum = tl.sum(((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), 1)
        return (x0, x1 * 0.0625, x2 * 0.00390625, x3 * 0.000244140625,
                x4, x5 * 0.0625, x6 * 0.00390625, x7 * 0.000244140625, xsum)

    @triton.jit
    def _n16(w, i: tl.constexpr):
        """Nibble ``i`` of int32 words as float16 (exact)."""
        return ((w >> (4 * i)) & 0xF).to(tl.float16)

    @triton.jit
    def _i4_half_dot(wq, xa, xb, xc, xd, ya, yb, yc, yd, z, ASM: tl.constexpr):
        """Per int64 pair of words of ``wq``: the sum of its sixteen nibbles less the zero
        points ``z`` (float32 ``[BLOCK_N, groups, 1]``) times the activations ``xa .. xd``
        (even word) and ``ya .. yd`` (odd word; :func:`_i4h_x`), in float16 eight to a lane,
        the lanes added in float32 (``_I4X16_DOT_F16``, the zero points as f16x2 ``1024 + z``
        and ``1024 + 16 z``, once a group; here the same sums in Triton ops)."""
        if ASM:
            c0 = _f16_pair(1024.0 + z, 1024.0 + z)
            c1 = _f16_pair(1024.0 + 16.0 * z, 1024.0 + 16.0 * z)
            out = tl.inline_asm_elementwise(_I4X16_DOT_F16, "=r,l,r,r,r,r,r,r,r,r,r,r",
                                            [wq, xa, xb, xc, xd, ya, yb, yc, yd, c0, c1],
                                            dtype=tl.float32, is_pure=True, pack=1)
        else:
            z16 = z.to(tl.float16)
            w0 = (wq & 0xFFFFFFFF).to(tl.int32)
            w1 = (wq >> 32).to(tl.int32)
            out = (_i4_half_word(w0, xa, xb, xc, xd, z16)
                   + _i4_half_word(w1, ya, yb, yc, yd, z16))
        return out

    @triton.jit
    def _i4_half_word(w, xa, xb, xc, xd, z16):
        """One word's eight products for :func:`_i4_half_dot` off CUDA (Triton ops)."""
        lo = ((_n16(w, 0) - z16) * _h16(xa, False)
              + ((_n16(w, 1) - z16) * 16.0) * _h16(xb, False)
              + (_n16(w, 2) - z16) * _h16(xc, False)
              + ((_n16(w, 3) - z16) * 16.0) * _h16(xd, False))
        hi = ((_n16(w, 4) - z16) * _h16(xa, True)
              + ((_n16(w, 5) - z16) * 16.0) * _h16(xb, True)
              + (_n16(w, 6) - z16) * _h16(xc, True)
              + ((_n16(w, 7) - z16) * 16.0) * _h16(xd, True))
        return lo.to(tl.float32) + hi.to(tl.float32)

    @triton.jit
    def _i4_dot(wq, s, z, x0, x1, x2, x3, x4, x5, x6, x7, xsum, ASM: tl.constexpr = False,
                PROBE: tl.constexpr = False, HALF: tl.constexpr = False, inv_p=1.0):
        """Row sums of the INT4 words ``wq [BLOCK_N, NG, W]`` times the activations:
        ``sum_g s * (sum(q * x) - z * sum(x))``. ``ASM``: each nibble's mask-and-OR is one
        ``lop3`` (Triton's code spends two logic instructions on it, in the SASS for sm_90).
        ``PROBE``: see ``QConfig.probe``."""
        if PROBE:
            return tl.sum(s * tl.sum(wq.to(tl.float32, bitcast=True) * x0[None, :, :], 2), 1)
        if HALF:    # x0 .. x7: the f16x2 pairs; the sums scaled back by ``inv_p``
            part = tl.sum(_i4_half_dot(wq, x0[None, :, :], x1[None, :, :], x2[None, :, :],
                                       x3[None, :, :], x4[None, :, :], x5[None, :, :],
                                       x6[None, :, :], x7[None, :, :], z[:, :, None], ASM), 2)
            return tl.sum(s * part, 1) * inv_p
        if ASM:
            n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
                _I4X8_TO_F32, "=r,=r,=r,=r,=r,=r,=r,=r,r", [wq],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32,
                       tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            hi = wq >> 16
            n0, n1, n2, n3 = _nib(wq, 0xF), _nib(wq, 0xF0), _nib(wq, 0xF00), _nib(wq, 0xF000)
            n4, n5, n6, n7 = _nib(hi, 0xF), _nib(hi, 0xF0), _nib(hi, 0xF00), _nib(hi, 0xF000)
        acc = n0 * x0[None, :, :]
        acc += n1 * x1[None, :, :]
        acc += n2 * x2[None, :, :]
        acc += n3 * x3[None, :, :]
        acc += n4 * x4[None, :, :]
        acc += n5 * x5[None, :, :]
        acc += n6 * x6[None, :, :]
        acc += n7 * x7[None, :, :]
        return tl.sum(s * (tl.sum(acc, 2) - z * xsum[None, :]), 1)

    @triton.jit
    def _i4_block(q_ptr, s_ptr, z_ptr, rows, ok, N: tl.constexpr, K: tl.constexpr,
                  KS: tl.constexpr, W: tl.constexpr, NB0: tl.constexpr, NB1: tl.constexpr,
                  TWO: tl.constexpr, GATE_UP: tl.constexpr, EVICT: tl.constexpr,
                  HALF: tl.constexpr = False):
        """:func:`_fp8_block` for INT4: words, scales and zero points."""
        a0 = _i4_raw(q_ptr, rows, ok, 0, NB0, K, W, EVICT, HALF)
        sa0, za0 = _i4_sz(s_ptr, z_ptr, rows, ok, 0, NB0, KS)
        a1, sa1, za1 = a0, sa0, za0
        if TWO:
            a1 = _i4_raw(q_ptr, rows, ok, NB0, NB1, K, W, EVICT, HALF)
            sa1, za1 = _i4_sz(s_ptr, z_ptr, rows, ok, NB0, NB1, KS)
        g0, g1, sg0, zg0, sg1, zg1 = a0, a1, sa0, za0, sa1, za1
        if GATE_UP:
            g0 = _i4_raw(q_ptr, rows + N, ok, 0, NB0, K, W, EVICT, HALF)
            sg0, zg0 = _i4_sz(s_ptr, z_ptr, rows + N, ok, 0, NB0, KS)
            g1, sg1, zg1 = g0, sg0, zg0
            if TWO:
                g1 = _i4_raw(q_ptr, rows + N, ok, NB0, NB1, K, W, EVICT, HALF)
                sg1, zg1 = _i4_sz(s_ptr, z_ptr, rows + N, ok, NB0, NB1, KS)
        return a0, a1, sa0, za0, sa1, za1, g0, g1, sg0, zg0, sg1, zg1

    @triton.jit
    def _i4_gemv_kernel(q_ptr, s_ptr, z_ptr, x_ptr, out_ptr, ln_ptr, res_ptr, eps,
                        N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, KS: tl.constexpr,
                        SK: tl.constexpr, NB0: tl.constexpr, NB1: tl.constexpr,
                        BLOCK_N: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                        GATE_UP: tl.constexpr, PDL: tl.constexpr, P: tl.constexpr,
                        AHEAD: tl.constexpr = 1, EVICT: tl.constexpr = "",
                        ASM: tl.constexpr = False, PROBE: tl.constexpr = False,
                        HALF: tl.constexpr = False):
        """:func:`_fp8_gemv_kernel` for INT4: the pieces are ``NB0`` and ``NB1`` groups.
        ``ASM``, ``PROBE``, ``HALF``: see :func:`_i4_dot` (``HALF``: the activations scaled
        by :func:`_half_scale`'s power of two, the group sums by its inverse)."""
        W: tl.constexpr = SK // 8
        TWO: tl.constexpr = NB0 * SK < K
        pid = tl.program_id(0)
        n_blocks: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        iters: tl.constexpr = (n_blocks + P - 1) // P
        dt = x_ptr.dtype.element_ty
        r = tl.arange(0, BLOCK_N)
        rows = pid * BLOCK_N + r
        a0, a1, sa0, za0, sa1, za1, g0, g1, sg0, zg0, sg1, zg1 = _i4_block(
            q_ptr, s_ptr, z_ptr, rows, rows < N, N, K, KS, W, NB0, NB1, TWO, GATE_UP, EVICT,
            HALF)
        if AHEAD == 2:
            rows = rows + P * BLOCK_N
            b0, b1, sb0, zb0, sb1, zb1, h0, h1, sh0, zh0, sh1, zh1 = _i4_block(
                q_ptr, s_ptr, z_ptr, rows, rows < N, N, K, KS, W, NB0, NB1, TWO, GATE_UP,
                EVICT, HALF)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        rstd = 0.0
        if NORM:
            rstd = _x_rstd(x_ptr, K, KP, eps)
        hp, inv_p = 1.0, 1.0
        if HALF:
            hp, inv_p = _half_scale(x_ptr, ln_ptr, K, KP, rstd, dt, NORM)
        p0, p1, p2, p3, p4, p5, p6, p7, ps = _i4_x(x_ptr, ln_ptr, 0, NB0, W, K, rstd, dt, NORM,
                                                   HALF, hp)
        q0, q1, q2, q3, q4, q5, q6, q7, qs = p0, p1, p2, p3, p4, p5, p6, p7, ps
        if TWO:
            q0, q1, q2, q3, q4, q5, q6, q7, qs = _i4_x(x_ptr, ln_ptr, NB0, NB1, W, K, rstd, dt,
                                                       NORM, HALF, hp)
        for it in range(iters):
            rows = (pid + it * P) * BLOCK_N + r
            nrows = rows + AHEAD * P * BLOCK_N
            c0, c1, sc0, zc0, sc1, zc1, e0, e1, se0, ze0, se1, ze1 = _i4_block(
                q_ptr, s_ptr, z_ptr, nrows, nrows < N, N, K, KS, W, NB0, NB1, TWO, GATE_UP,
                EVICT, HALF)
            y = _i4_dot(a0, sa0, za0, p0, p1, p2, p3, p4, p5, p6, p7, ps, ASM, PROBE, HALF,
                        inv_p)
            if TWO:
                y += _i4_dot(a1, sa1, za1, q0, q1, q2, q3, q4, q5, q6, q7, qs, ASM, PROBE,
                             HALF, inv_p)
            u = y
            if GATE_UP:
                u = _i4_dot(g0, sg0, zg0, p0, p1, p2, p3, p4, p5, p6, p7, ps, ASM, PROBE,
                            HALF, inv_p)
                if TWO:
                    u += _i4_dot(g1, sg1, zg1, q0, q1, q2, q3, q4, q5, q6, q7, qs,
                                 ASM, PROBE, HALF, inv_p)
            store_rows(y, u, rows, rows < N, res_ptr, out_ptr, dt, GATE_UP, RESIDUAL)
            if AHEAD == 2:
                a0, a1, sa0, za0, sa1, za1, g0, g1, sg0, zg0, sg1, zg1 = (
                    b0, b1, sb0, zb0, sb1, zb1, h0, h1, sh0, zh0, sh1, zh1)
                b0, b1, sb0, zb0, sb1, zb1, h0, h1, sh0, zh0, sh1, zh1 = (
                    c0, c1, sc0, zc0, sc1, zc1, e0, e1, se0, ze0, se1, ze1)
            else:
                a0, a1, sa0, za0, sa1, za1, g0, g1, sg0, zg0, sg1, zg1 = (
                    c0, c1, sc0, zc0, sc1, zc1, e0, e1, se0, ze0, se1, ze1)
