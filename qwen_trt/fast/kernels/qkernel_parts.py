"""Triton pieces the packed-weight GEMVs share (:mod:`qwen_trt.fast.kernels.qkernels_fp8`,
:mod:`qwen_trt.fast.kernels.qkernels_int4`): the activations with the RMSNorm prologue, f16x2
packing, the f16x2 forms' power-of-two activation scale, the RMSNorm's reciprocal RMS."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


if triton is not None:
    @triton.jit
    def _norm_x(x_ptr, ln_ptr, offs, ok, rstd, dt: tl.constexpr, NORM: tl.constexpr):
        """Activations at ``offs`` (any shape) in float32, RMSNorm-ed like the unfused op
        when NORM."""
        xv = tl.load(x_ptr + offs, mask=ok, other=0.0)
        if NORM:
            g = tl.load(ln_ptr + offs, mask=ok, other=0.0)
            xv = (g.to(tl.float32) * (xv.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)
        return xv.to(tl.float32)

    @triton.jit
    def _h16(p, HI: tl.constexpr):
        """The low (high, ``HI``) f16 of packed f16x2 int32 words, as float16."""
        v = (p >> 16) if HI else p
        return (v & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)

    @triton.jit
    def _x8(x_ptr, ln_ptr, col, ok, rstd, dt: tl.constexpr, NORM: tl.constexpr):
        """:func:`_norm_x` of columns ``col .. col + 7`` (eight float32 tiles)."""
        return (_norm_x(x_ptr, ln_ptr, col, ok, rstd, dt, NORM),
                _norm_x(x_ptr, ln_ptr, col + 1, ok, rstd, dt, NORM),
                _norm_x(x_ptr, ln_ptr, col + 2, ok, rstd, dt, NORM),
                _norm_x(x_ptr, ln_ptr, col + 3, ok, rstd, dt, NORM),
                _norm_x(x_ptr, ln_ptr, col + 4, ok, rstd, dt, NORM),
                _norm_x(x_ptr, ln_ptr, col + 5, ok, rstd, dt, NORM),
                _norm_x(x_ptr, ln_ptr, col + 6, ok, rstd, dt, NORM),
                _norm_x(x_ptr, ln_ptr, col + 7, ok, rstd, dt, NORM))

    @triton.jit
    def _f16_pair(lo, hi):
        """float32 tiles -> int32 words of f16x2 (``lo`` in the low half)."""
        a = lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
        b = hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
        return a | (b << 16)

    @triton.jit
    def _half_scale(x_ptr, ln_ptr, K: tl.constexpr, KP: tl.constexpr, rstd, dt: tl.constexpr,
                    NORM: tl.constexpr):
        """``(p, 1 / p)``: the power of two ``p`` that brings the activations' largest
        magnitude (after the RMSNorm prologue) into ``[16, 32)``, so that four products with
        FP8 weights (``|q| <= 448``) and their sum stay inside float16's range (NaN and
        infinity stay what they are)."""
        cols = tl.arange(0, KP)
        amax = tl.max(tl.abs(_norm_x(x_ptr, ln_ptr, cols, cols < K, rstd, dt, NORM)), 0)
        e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF     # amax < 2 ** (e - 126)
        pe = tl.minimum(tl.maximum(258 - e, 1), 253)           # p = 2 ** (131 - e)
        return (pe << 23).to(tl.float32, bitcast=True), ((254 - pe) << 23).to(
            tl.float32, bitcast=True)

    @triton.jit
    def _x_rstd(x_ptr, K: tl.constexpr, KP: tl.constexpr, eps):
        cols = tl.arange(0, KP)
        xv = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        return tl.rsqrt(tl.sum(xv * xv, 0) / K + eps)
