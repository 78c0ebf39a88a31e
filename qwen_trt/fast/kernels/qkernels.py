"""Triton kernels for packed projections (:mod:`qwen_trt.fast.model.qformats`): FP8 (128x128 block
scales) and INT4 (group scales and zero points), dequantized in registers (W8A16 / W4A16: the
activations stay in the model dtype, no FP8 tensor cores needed).

* :func:`qgemv` -- batch 1, with the fusions of :func:`qwen_trt.fast.gemv.gemv` (RMSNorm
  prologue, residual, ``silu(gate) * up``). Built like the bf16 persistent GEMV: a fixed grid
  of programs, each loading whole rows of ``BLOCK_N`` weight rows with the next row block's
  loads in flight while the current one is reduced. A row is held as ``[blocks, SK]`` tiles
  (FP8 bytes; INT4 ``[groups, SK / 8]`` int32 words), in at most two pieces whose block counts
  are powers of two (2560 columns = 16 + 4 blocks of 128), so no lanes are spent on padding.
  Products are reduced per scale block / group first and scaled once per block (the scales
  are a ``[rows, blocks]`` tile, loaded once per row block). INT4 nibbles become floats
  without an int-to-float conversion: nibble ``j`` of a 16-bit half, masked in place and OR-ed
  into the bits of ``2**23``, is the float ``2**23 + q * 16**j`` exactly; subtracting ``2**23``
  leaves ``q * 16**j``, which multiplies the activation pre-scaled by ``16**-j`` (exact: a
  power of two). The zero point comes in per group as ``s * (sum(q * x) - z * sum(x))``.
* :func:`qgemv` with ``QConfig(dot=True)`` (issue 26, a sweep candidate, not yet a default):
  the same batch-1 product on the tensor cores, built for bytes in flight rather than
  instructions: each program takes a ``BLOCK_N``-row block (and a ``1 / split`` share of K)
  and loops over steps of whole scale blocks / groups in a ``tl.range(num_stages=...)`` loop,
  which Triton software-pipelines: the weight tiles are copied to shared memory with
  ``cp.async`` ``stages - 1`` steps ahead (24-48 KB a program, in no registers), the upcast
  tile is the A operand of ``wgmma`` (64-row blocks) or ``mma.sync`` (16/32) and the
  activations column 0 of a ``[block, 16]`` B operand. Every fusion (RMSNorm prologue,
  residual, ``silu(gate) * up``); split-K partials finish in :func:`_mm_finish_kernel`.
* :func:`qbgemm` -- 2..64 rows, the fusions of :func:`qwen_trt.fast.bgemm.bgemm`, for FP8,
  INT4 and dense weights: each program multiplies all M rows with a ``BLOCK_N``-row strip over
  its share of K (split-K: ``SPLIT`` programs per strip write float32 partials that one small
  kernel sums and finishes), one scale block / group per step with ``tl.dot``: FP8 values are
  exact in bf16 and the block's scale multiplies the float32 product; INT4 runs one 16-column
  dot per nibble position (the columns ``8c + i`` of the group), so the packed words are never
  reshaped, and applies ``s * (dot - z * sum(x))`` per group.
* :func:`dequantize` -- the whole matrix back to the model dtype (prefill: dequantize, then
  the bf16 GEMM).

``gemv``/``bgemm`` call these when handed a :class:`~qwen_trt.fast.model.qformats.PackedLinear`. INT4
values of a row are 8 to an int32 word (column ``8j + i`` in bits ``4i``). Both kernels compute
on the exact float32 dequantized weights (the reference rounds them to the model dtype first:
the results agree to that rounding).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from qwen_trt.fast.kernels.kernel_parts import silu_mul, store_rows
from qwen_trt.fast.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled
from qwen_trt.fast.model.qformats import Fp8Linear, Int4Linear, PackedLinear

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


@dataclass(frozen=True)
class QConfig:
    """GEMV: ``block_n`` rows per row block, ``warps``, ``ctas_per_sm`` programs per SM (or
    exactly ``programs``). GEMM: ``block_n`` rows per strip, ``warps``, ``stages`` (software
    pipelining of the plain loop), ``split`` programs along K, ``prefetch`` (the next step's
    weights loaded by hand before the current step's dot, instead of ``stages``)."""

    block_n: int = 4
    warps: int = 4
    ctas_per_sm: int = 2
    programs: int = 0
    stages: int = 3
    split: int = 1
    prefetch: bool = False
    bk: int = 128         # dense GEMM: columns per step
    ahead: int = 1        # GEMV: row blocks whose loads are in flight (1 or 2)
    asm: bool = False     # GEMV: inline PTX on CUDA (FP8: int32 word loads, four bytes
                          # converted in place, by shifts elsewhere; INT4: one lop3 a nibble);
                          # not yet timed on a GPU
    fold: bool = False    # GEMV: FP8 with the block scales folded into the activations (int32
                          # word loads, one reduction a row; needs the rows of a row block in
                          # one scale row); INT4: see ``_i4_gemv_kernel``
    dot: bool = False     # GEMV: the tensor-core form (``_dq_gemv_kernel``): ``block_n`` rows
                          # x ``bk`` columns a pipeline stage, ``stages`` in flight (Triton's
                          # software pipelining), ``split`` programs along K; not yet timed
    l2pre: int = 0        # GEMV ``dot``: pipeline steps of each program's weights prefetched
                          # into L2 before the PDL wait (CUDA only)
    half: bool = False    # GEMV: the products formed and summed four at a time in f16x2 (the
                          # activations scaled by a power of two that keeps them in range):
                          # FP8 from int64 word loads, INT4 two nibbles a lop3 into 1024.0
                          # (0x6400); about 3 and 2-3 SASS instructions a weight
    probe: bool = False   # GEMV fold / INT4, a diagnostic for the sweep only (wrong results):
                          # the same loads, but each int32 word bitcast to one float32 and
                          # multiplied once (no per-weight unpacking or conversion), to tell
                          # the kernel's memory stream from its arithmetic


FMT_FP8, FMT_INT4, FMT_DENSE = 0, 1, 2


def _fmt_args(w):
    """(q, scale, zero, SN, SK, FMT, scale columns) of a weight for the kernels."""
    if isinstance(w, Fp8Linear):
        q = w.weight.view(torch.uint8)     # bit patterns; the kernels bitcast to float8e4nv
        return q, w.scale, w.scale, w.block[0], w.block[1], FMT_FP8, w.scale.shape[1]
    if isinstance(w, Int4Linear):
        return w.qweight, w.scales, w.zeros, 1, w.group, FMT_INT4, w.scales.shape[1]
    if isinstance(w, torch.Tensor):
        return w, w, w, 1, 1, FMT_DENSE, 1
    raise TypeError(f"no kernels for weight format {type(w).__name__}")


def _pieces(blocks: int) -> tuple[int, int]:
    """A row of ``blocks`` scale blocks / groups as two power-of-two pieces ``(a, b)`` with
    ``a + b >= blocks`` (``b`` covers the rest; 1 and empty when ``a`` covers all)."""
    a = 1 << (blocks.bit_length() - 1)
    rest = blocks - a
    return a, (triton.next_power_of_2(rest) if rest else 1)


# The fastest configuration per Qwen3-4B projection in a sweep on an H200
# (``python -m qwen_trt.bench.qkernel_sweep``; docs/measurements/qkernel-sweep-h200.json):
# (fmt, n, k, gate_up) -> GEMV config (block_n, warps, ctas_per_sm, ahead), µs per call and
# TB/s of packed bytes; the FP8 rows from the GEMV-only sweeps of the folded-scale kernel
# (docs/measurements/qkernel-sweep-fold-h200.json) and of the f16x2 one, with every earlier
# candidate (qkernel-sweep-half-h200.json); the INT4 rows (all f16x2) and the FP8 ones again
# from the sweep of both formats (qkernel-sweep-int4-half-h200.json). Shapes not listed use
# :func:`_gemv_default`.
GEMV_TABLE: dict[tuple[int, int, int, bool], QConfig] = {
    (FMT_FP8, 6144, 2560, False): QConfig(4, 8, 2, ahead=1, fold=True),  # 7.96 us, 1.976 TB/s
    (FMT_INT4, 6144, 2560, False): QConfig(8, 8, 2, ahead=1, half=True),  # 8.64 us, 0.953 TB/s
    (FMT_FP8, 2560, 4096, False): QConfig(4, 8, 2, ahead=1, fold=True),  # 5.49 us, 1.91 TB/s
    (FMT_INT4, 2560, 4096, False): QConfig(8, 8, 1, ahead=2, half=True),  # 6.88 us, 0.798 TB/s
    # gate_up: the f16x2 form (docs/measurements/qkernel-sweep-half-h200.json, 2026-12-01),
    # against 20.28 us for the inline-PTX byte form in the same run
    (FMT_FP8, 9728, 2560, True): QConfig(8, 8, 1, ahead=1, half=True),  # 17.07 us, 2.918 TB/s
    (FMT_INT4, 9728, 2560, True): QConfig(4, 4, 3, ahead=1, half=True),  # 19.38 us, 1.345 TB/s
    (FMT_FP8, 2560, 9728, False): QConfig(4, 16, 1, ahead=1, fold=True),  # 12.02 us, 2.073 TB/s
    (FMT_INT4, 2560, 9728, False): QConfig(4, 8, 1, ahead=1, half=True),  # 14.4 us, 0.905 TB/s
}


def _gemv_default(fmt: int, n: int, k: int) -> QConfig:
    """About 16 KB of packed weights per row block, two programs per SM."""
    row_bytes = k if fmt == FMT_FP8 else k // 2
    bn = max(1, min(16, 1 << max(0, (16384 // row_bytes).bit_length() - 1)))
    return QConfig(block_n=bn, warps=4, ctas_per_sm=2)


def gemv_config(fmt: int, n: int, k: int, gate_up: bool) -> QConfig:
    return GEMV_TABLE.get((fmt, n, k, gate_up)) or _gemv_default(fmt, n, k)


# (fmt, n, k, block_m) -> GEMM config, from the same sweep (block_m 16 timed at 8 rows, 32 at
# 32; µs per call). Dense shapes are listed only where the split-K form beat ``bgemm.bgemm``.
GEMM_TABLE: dict[tuple[int, int, int, int], QConfig] = {
    (FMT_FP8, 6144, 2560, 16): QConfig(64, 4, stages=3, split=4),  # 10.73 us
    (FMT_INT4, 6144, 2560, 16): QConfig(64, 4, stages=1, split=4, prefetch=True),  # 27.71 us
    (FMT_DENSE, 6144, 2560, 16): QConfig(64, 4, stages=4, split=4),  # 11.22 us
    (FMT_FP8, 6144, 2560, 32): QConfig(64, 4, stages=4, split=4),  # 13.59 us
    (FMT_INT4, 6144, 2560, 32): QConfig(64, 4, stages=1, split=4, prefetch=True),  # 81.75 us
    (FMT_FP8, 2560, 4096, 16): QConfig(64, 4, stages=3, split=8),  # 11.17 us
    (FMT_INT4, 2560, 4096, 16): QConfig(64, 4, stages=3, split=8),  # 22.24 us
    (FMT_DENSE, 2560, 4096, 16): QConfig(64, 4, stages=4, split=8),  # 9.25 us
    (FMT_FP8, 2560, 4096, 32): QConfig(64, 4, stages=4, split=8),  # 11.78 us
    (FMT_INT4, 2560, 4096, 32): QConfig(64, 4, stages=1, split=8, prefetch=True),  # 66.75 us
    (FMT_DENSE, 2560, 4096, 32): QConfig(64, 4, stages=4, split=8),  # 10.78 us
    (FMT_FP8, 9728, 2560, 16): QConfig(64, 4, stages=4, split=2),  # 27.17 us
    (FMT_INT4, 9728, 2560, 16): QConfig(64, 4, stages=1, split=2, prefetch=True),  # 44.21 us
    (FMT_FP8, 9728, 2560, 32): QConfig(64, 4, stages=3, split=2),  # 35.67 us
    (FMT_INT4, 9728, 2560, 32): QConfig(64, 4, stages=4, split=2),  # 107.79 us
    (FMT_FP8, 2560, 9728, 16): QConfig(64, 4, stages=3, split=8),  # 19.94 us
    (FMT_INT4, 2560, 9728, 16): QConfig(64, 4, stages=3, split=8),  # 52.77 us
    (FMT_DENSE, 2560, 9728, 16): QConfig(64, 4, stages=3, split=8),  # 17.61 us
    (FMT_FP8, 2560, 9728, 32): QConfig(64, 4, stages=4, split=8),  # 21.47 us
    (FMT_INT4, 2560, 9728, 32): QConfig(64, 4, stages=1, split=8, prefetch=True),  # 157.17 us
    (FMT_DENSE, 2560, 9728, 32): QConfig(64, 4, stages=3, split=8),  # 20.45 us
}


def gemm_config(fmt: int, n: int, k: int, block_m: int) -> QConfig:
    cfg = GEMM_TABLE.get((fmt, n, k, block_m))
    if cfg:
        return cfg
    bn = 64 if n >= 4096 else 32
    strips = -(-n // bn)
    steps = -(-k // 128)
    split = 1
    while strips * split < 264 and steps // (split * 2) >= 4:
        split *= 2
    return QConfig(block_n=bn, warps=4, stages=3, split=split)


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

    @triton.jit
    def _norm_x(x_ptr, ln_ptr, offs, ok, rstd, dt: tl.constexpr, NORM: tl.constexpr):
        """Activations at ``offs`` (any shape) in float32, RMSNorm-ed like the unfused op
        when NORM."""
        xv = tl.load(x_ptr + offs, mask=ok, other=0.0)
        if NORM:
            g = tl.load(ln_ptr + offs, mask=ok, other=0.0)
            xv = (g.to(tl.float32) * (xv.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)
        return xv.to(tl.float32)

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
    def _h16(p, HI: tl.constexpr):
        """The low (high, ``HI``) f16 of packed f16x2 int32 words, as float16."""
        v = (p >> 16) if HI else p
        return (v & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)

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

    # ---- batch 1: tensor-core form, pipelined (FP8 and INT4) ----------------------------

    # one L2 prefetch of the 128-byte line at a pointer (no registers held, nothing waited on)
    _PREFETCH_L2 = tl.constexpr("prefetch.global.L2 [$1];\nmov.u32 $0, 0;")

    @triton.jit
    def _dq_dot(w, x, IEEE: tl.constexpr):
        """``w [BLOCK_N, k] @ x [k, 16]`` in float32."""
        if IEEE:
            return tl.dot(w, x, input_precision="ieee")
        else:
            return tl.dot(w, x)

    @triton.jit
    def _dq_block(q_ptr, s_ptr, z_ptr, x_ptr, ln_ptr, rows, row_ok, b, acc, rstd,
                  K: tl.constexpr, KS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                  FMT: tl.constexpr, NORM: tl.constexpr, IEEE: tl.constexpr,
                  dt: tl.constexpr):
        """``acc [BLOCK_N, 16]`` plus scale block / group ``b``'s products of ``rows`` (clamped
        to the matrix: rows past it and blocks past K, ``b >= KS``, load real weights and
        get scale 0): the weights are the dot's A operand (``BLOCK_N`` rows by the block's
        ``SK`` columns), the activations column 0 of a ``[SK, 16]`` B operand (columns 1..15
        zero), so every column of ``acc`` but the first stays zero. FP8: the block's
        products scaled once per row (float32). INT4: one 16-column dot per nibble position
        ``i`` (the columns ``8c + i`` of the group) and ``s * (dot - z * sum(x))``. The
        weights load without a mask where K is whole blocks, so Triton may copy them to
        shared memory asynchronously (a mask along K would make every byte its own load)."""
        c = tl.arange(0, 16)
        c0 = (c == 0)[None, :]
        bc = tl.minimum(b, KS - 1)
        b_ok = (tl.zeros([1], tl.int32) + b) < KS     # a [1] mask (a scalar bool in a tensor
                                                       # mask is an integer to the interpreter)
        if FMT == 0:
            kk = bc * SK + tl.arange(0, SK)
            # loaded as float8e4nv: the load feeds the dot through one upcast
            q8 = q_ptr.to(tl.pointer_type(tl.float8e4nv))
            wp = q8 + rows[:, None] * K + kk[None, :]
            if K % SK == 0:
                raw = tl.load(wp)
                xm = c0
            else:
                raw = tl.load(wp, mask=(kk < K)[None, :], other=0.0)
                xm = (kk < K)[:, None] & c0
            w = raw.to(dt)      # exact in bf16 / fp32
            xv = _norm_x(x_ptr, ln_ptr, kk[:, None] + c[None, :] * 0, xm, rstd, dt,
                         NORM).to(dt)
            s = tl.load(s_ptr + (rows // SN) * KS + bc, mask=row_ok & b_ok, other=0.0)
            acc += _dq_dot(w, xv, IEEE) * s[:, None]
        else:
            W: tl.constexpr = SK // 8
            j = bc * W + tl.arange(0, W)
            raw = tl.load(q_ptr + rows[:, None] * (K // 8) + j[None, :])
            xo = (j * 8)[:, None] + c[None, :] * 0
            d = tl.zeros(acc.shape, tl.float32)
            xs = tl.zeros([16], tl.float32)
            for i in tl.static_range(8):
                xi = _norm_x(x_ptr, ln_ptr, xo + i, c0, rstd, dt, NORM)
                qi = ((((raw >> (4 * i)) & 15) | 0x4B000000).to(tl.float32, bitcast=True)
                      - 8388608.0)
                if W >= 16:
                    d += _dq_dot(qi.to(dt), xi.to(dt), IEEE)
                else:    # too narrow for tl.dot (groups < 128 columns: small test models)
                    d += tl.sum(qi[:, :, None] * xi[None, :, :], 1)
                xs += tl.sum(xi, 0)
            g = rows * KS + bc
            gm = row_ok & b_ok
            s = tl.load(s_ptr + g, mask=gm, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g, mask=gm, other=0).to(tl.float32)
            acc += (d - z[:, None] * xs[None, :]) * s[:, None]
        return acc

    @triton.jit
    def _dq_prefetch(q_ptr, rows, row_ok, t0, K: tl.constexpr, SK: tl.constexpr,
                     NSB: tl.constexpr, FMT: tl.constexpr, LINES: tl.constexpr):
        """L2 prefetches of ``LINES`` 128-byte weight lines of each of ``rows`` from step
        ``t0`` on."""
        ROWB: tl.constexpr = K if FMT == 0 else K // 2            # bytes of a row
        STEPB: tl.constexpr = NSB * SK if FMT == 0 else NSB * SK // 2
        off = t0 * STEPB + tl.arange(0, LINES) * 128
        q8 = q_ptr.to(tl.pointer_type(tl.uint8))
        p = q8 + rows[:, None].to(tl.int64) * ROWB + off[None, :]
        ok = row_ok[:, None] & (off < ROWB)[None, :]
        p = tl.where(ok, p, q8)       # masked-off lines: the tensor's first line (harmless)
        d = tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l", [p], dtype=tl.int32,
                                      is_pure=False, pack=1)
        return d

    @triton.jit
    def _dq_gemv_kernel(q_ptr, s_ptr, z_ptr, x_ptr, out_ptr, ln_ptr, res_ptr, part_ptr, eps,
                        N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                        KS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                        FMT: tl.constexpr, BLOCK_N: tl.constexpr, NSB: tl.constexpr,
                        SPLIT: tl.constexpr, STAGES: tl.constexpr, NORM: tl.constexpr,
                        RESIDUAL: tl.constexpr, GATE_UP: tl.constexpr, PDL: tl.constexpr,
                        IEEE: tl.constexpr, L2LINES: tl.constexpr = 0):
        """Batch 1 on the tensor cores, for bytes in flight: program ``pid`` takes row block
        ``pid // SPLIT`` (``BLOCK_N`` rows, and their up rows ``N`` further on with
        ``GATE_UP``) and K share ``pid % SPLIT``, a loop of steps of ``NSB`` scale blocks /
        groups (``NSB * SK`` columns) that Triton software-pipelines ``STAGES`` deep (the
        weight tiles go to shared memory by asynchronous copies, ``STAGES - 1`` steps ahead,
        holding no registers). ``SPLIT > 1``: float32 partials ``[SPLIT, N]`` (gate_up:
        ``[SPLIT, 2N]``) for :func:`_mm_finish_kernel`; else the finished rows.
        ``L2LINES``: that many 128-byte lines of each row's weights (from its share's start)
        prefetched into L2 before the PDL wait."""
        T: tl.constexpr = (KS + NSB - 1) // NSB             # steps along K
        TS: tl.constexpr = (T + SPLIT - 1) // SPLIT         # steps per program
        pid = tl.program_id(0)
        rb = pid // SPLIT
        sp = pid % SPLIT
        t0 = sp * TS
        rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows = tl.minimum(rows, N - 1)        # unmasked weight loads (see _dq_block)
        dt = x_ptr.dtype.element_ty
        if L2LINES > 0:
            _dq_prefetch(q_ptr, rows, row_ok, t0, K, SK, NSB, FMT, L2LINES)
            if GATE_UP:
                _dq_prefetch(q_ptr, rows + N, row_ok, t0, K, SK, NSB, FMT, L2LINES)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        rstd = 0.0
        if NORM:
            rstd = _x_rstd(x_ptr, K, KP, eps)
        acc = tl.zeros([BLOCK_N, 16], tl.float32)
        acc2 = tl.zeros([BLOCK_N, 16], tl.float32)
        for i in tl.range(0, TS, num_stages=STAGES):
            for jb in tl.static_range(NSB):
                b = (t0 + i) * NSB + jb
                acc = _dq_block(q_ptr, s_ptr, z_ptr, x_ptr, ln_ptr, rows, row_ok, b, acc, rstd,
                                K, KS, SN, SK, FMT, NORM, IEEE, dt)
                if GATE_UP:
                    acc2 = _dq_block(q_ptr, s_ptr, z_ptr, x_ptr, ln_ptr, rows + N, row_ok, b,
                                     acc2, rstd, K, KS, SN, SK, FMT, NORM, IEEE, dt)
        y = tl.sum(acc, 1)
        u = tl.sum(acc2, 1)
        if SPLIT > 1:
            NOUT: tl.constexpr = 2 * N if GATE_UP else N
            tl.store(part_ptr + sp * NOUT + rows, y, mask=row_ok)
            if GATE_UP:
                tl.store(part_ptr + sp * NOUT + N + rows, u, mask=row_ok)
        else:
            store_rows(y, u, rows, row_ok, res_ptr, out_ptr, dt, GATE_UP, RESIDUAL)

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


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, n_blocks: int, cfg: QConfig) -> int:
    if device.type != "cuda":            # the interpreter: a few programs, each looping
        return min(n_blocks, cfg.programs or 3)
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return min(n_blocks, cfg.programs or sms * cfg.ctas_per_sm)


def _dq_plan(fmt: int, n: int, k: int, ks: int, sk: int, sn: int, cfg: QConfig, *,
             norm: bool, residual: bool, gate_up: bool, pdl: bool, cuda: bool,
             ieee: bool = False) -> tuple[int, dict]:
    """(grid, constexpr arguments) of one :func:`_dq_gemv_kernel` launch: at least 16 rows a
    block (``tl.dot``), whole scale blocks / groups a step, at most one program per step
    along K."""
    nsb = max(1, cfg.bk // sk)
    bn = max(16, cfg.block_n)
    split = max(1, min(cfg.split, -(-ks // nsb)))
    step_bytes = nsb * sk if fmt == FMT_FP8 else nsb * sk // 2
    l2lines = (triton.next_power_of_2(max(1, cfg.l2pre * step_bytes // 128))
               if cfg.l2pre else 0)
    kw = dict(N=n, K=k, KP=triton.next_power_of_2(k), KS=ks, SN=sn, SK=sk, FMT=fmt,
              BLOCK_N=bn, NSB=nsb, SPLIT=split, STAGES=cfg.stages, NORM=norm,
              RESIDUAL=residual, GATE_UP=gate_up, PDL=pdl, IEEE=ieee,
              L2LINES=l2lines if cuda else 0)
    return triton.cdiv(n, bn) * split, kw


def _gemv_plan(fmt: int, n: int, k: int, ks: int, sk: int, sn: int, cfg: QConfig, *,
               norm: bool, residual: bool, gate_up: bool, pdl: bool, grid: int, cuda: bool):
    """(kernel, constexpr arguments) of one batch-1 launch (also what
    ``scripts/qkernel_sass.py`` compiles)."""
    if cfg.dot:
        return _dq_gemv_kernel, _dq_plan(fmt, n, k, ks, sk, sn, cfg, norm=norm,
                                         residual=residual, gate_up=gate_up, pdl=pdl,
                                         cuda=cuda)[1]
    nb0, nb1 = _pieces(ks)
    kw = dict(N=n, K=k, KP=triton.next_power_of_2(k), KS=ks, SK=sk, NB0=nb0, NB1=nb1,
              BLOCK_N=cfg.block_n, NORM=norm, RESIDUAL=residual, GATE_UP=gate_up, PDL=pdl,
              P=grid, AHEAD=cfg.ahead, EVICT="evict_first" if cuda else "")
    if fmt == FMT_FP8:
        # fold: a row block's rows (and its up rows, N further on) in one scale row
        if (cfg.fold and k % 16 == 0 and sk % 4 == 0 and sn % cfg.block_n == 0
                and (not gate_up or n % cfg.block_n == 0)):
            w0, w1 = (sk // 4) * nb0, (sk // 4) * nb1
            kw = {a: b for a, b in kw.items() if a not in ("NB0", "NB1")}
            return _f8w_gemv_kernel, dict(kw, SN=sn, NW0=w0, NW1=w1, ASM=cuda,
                                          **({"PROBE": True} if cfg.probe else {}))
        if cfg.half and k % 16 == 0 and sk % 8 == 0:    # int64 words, 16-byte aligned rows
            return _fp8_gemv_kernel, dict(kw, SN=sn, WORDS=False, ASM=cuda, HALF=True)
        words = cfg.asm and k % 16 == 0     # int32 words (the rows stay 16-byte aligned)
        return _fp8_gemv_kernel, dict(kw, SN=sn, WORDS=words, ASM=words and cuda)
    if cfg.half and k % 16 == 0 and sk % 16 == 0:   # int64 pairs of words, f16x2 math
        return _i4_gemv_kernel, dict(kw, ASM=cuda, HALF=True)
    return _i4_gemv_kernel, dict(kw, ASM=cfg.asm and cuda,
                                 **({"PROBE": True} if cfg.probe else {}))


def qgemv(w: PackedLinear, x: torch.Tensor, *, ln: torch.Tensor | None = None,
          eps: float = 0.0, residual: torch.Tensor | None = None, gate_up: bool = False,
          config: QConfig | None = None) -> torch.Tensor:
    """:func:`qwen_trt.fast.gemv.gemv` for a packed weight: ``[N]`` (``N`` = rows / 2 with
    ``gate_up``)."""
    q, s, z, sn, sk, fmt, ks = _fmt_args(w)
    if fmt == FMT_DENSE:
        raise TypeError("qgemv takes packed weights (dense ones: gemv)")
    n = w.n // 2 if gate_up else w.n
    k = w.k
    x = x.reshape(k)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    res = residual.reshape(n) if residual is not None else out
    pdl = pdl_enabled(x.device)
    cfg = config or gemv_config(fmt, n, k, gate_up)
    lnp = ln if ln is not None else x
    if cfg.dot:
        grid, kw = _dq_plan(fmt, n, k, ks, sk, sn, cfg, norm=ln is not None,
                            residual=residual is not None, gate_up=gate_up, pdl=pdl,
                            cuda=x.device.type == "cuda", ieee=x.dtype == torch.float32)
        split = kw["SPLIT"]
        part = (torch.empty(split, 2 * n if gate_up else n, dtype=torch.float32,
                            device=x.device) if split > 1 else out)
        _dq_gemv_kernel[(grid,)](q, s, z, x, out, lnp, res, part, eps, num_warps=cfg.warps,
                                 **kw, **launch_kwargs(pdl))
        if split > 1:
            block = 1024
            _mm_finish_kernel[(triton.cdiv(n, block),)](
                part, out, res, 1, N=n, SPLIT=split, BLOCK=block,
                RESIDUAL=residual is not None, GATE_UP=gate_up, PDL=pdl, num_warps=4,
                **launch_kwargs(pdl))
        return out
    grid = _programs(x.device, triton.cdiv(n, cfg.block_n), cfg)
    kern, kw = _gemv_plan(fmt, n, k, ks, sk, sn, cfg, norm=ln is not None,
                          residual=residual is not None, gate_up=gate_up, pdl=pdl, grid=grid,
                          cuda=x.device.type == "cuda")
    if fmt == FMT_FP8:
        kern[(grid,)](q, s, x, out, lnp, res, eps, num_warps=cfg.warps, **kw,
                      **launch_kwargs(pdl))
    else:
        kern[(grid,)](q, s, z, x, out, lnp, res, eps, num_warps=cfg.warps, **kw,
                      **launch_kwargs(pdl))
    return out


def qbgemm(w, x: torch.Tensor, *, residual: torch.Tensor | None = None,
           gate_up: bool = False, config: QConfig | None = None) -> torch.Tensor:
    """:func:`qwen_trt.fast.bgemm.bgemm` for a packed (or dense) weight: ``x [M, K]`` ->
    ``[M, N]``."""
    q, s, z, sn, sk, fmt, ks = _fmt_args(w)
    rows_w, k = (w.n, w.k) if fmt != FMT_DENSE else tuple(w.shape)
    n = rows_w // 2 if gate_up else rows_w
    m = x.shape[0]
    if not x.is_contiguous() or x.shape[1] != k:
        raise ValueError("qbgemm needs a contiguous x [M, K]")
    if residual is not None and not residual.is_contiguous():
        raise ValueError("qbgemm needs a contiguous residual")
    block_m = max(16, triton.next_power_of_2(m))
    cfg = config or gemm_config(fmt, n, k, block_m)
    bk = min(cfg.bk, triton.next_power_of_2(k)) if fmt == FMT_DENSE else sk
    steps = triton.cdiv(k, bk)
    split = max(1, min(cfg.split, steps))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res = residual if residual is not None else out
    part = (torch.empty(split, m, 2 * n if gate_up else n, dtype=torch.float32,
                        device=x.device) if split > 1 else out)
    pdl = pdl_enabled(x.device)
    _mm_kernel[(triton.cdiv(n, cfg.block_n), split)](
        q, s, z, x, out, part, res, m, N=n, K=k, KS=ks, SN=sn, SK=sk, BK=bk, FMT=fmt,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, SPLIT=split, PREFETCH=cfg.prefetch,
        RESIDUAL=residual is not None, GATE_UP=gate_up, IEEE=x.dtype == torch.float32,
        PDL=pdl, num_warps=cfg.warps, num_stages=cfg.stages, **launch_kwargs(pdl))
    if split > 1:
        block = 1024
        _mm_finish_kernel[(triton.cdiv(m * n, block),)](
            part, out, res, m, N=n, SPLIT=split, BLOCK=block, RESIDUAL=residual is not None,
            GATE_UP=gate_up, PDL=pdl, num_warps=4, **launch_kwargs(pdl))
    return out


def dequantize(w: PackedLinear, dtype: torch.dtype, block_n: int = 32) -> torch.Tensor:
    """The dense ``[N, K]`` weights in ``dtype`` (one Triton kernel; the same values as
    :meth:`PackedLinear.dequantize`)."""
    q, s, z, sn, sk, fmt, ks = _fmt_args(w)
    out = torch.empty(w.n, w.k, dtype=dtype, device=q.device)
    _dequant_kernel[(triton.cdiv(w.n, block_n), triton.cdiv(w.k, sk))](
        q, s, z, out, N=w.n, K=w.k, KS=ks, SN=sn, SK=sk, BLOCK_N=block_n, FMT=fmt,
        num_warps=4)
    return out


def act_quant(x: torch.Tensor, group: int = 128, block_m: int = 16
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~qwen_trt.fast.model.qformats.fp8_act_quant` in one Triton kernel: ``(q [M, K],
    scale [M, K / group])``, the scales outer-dimension-major (stride ``(1, M)``)."""
    m, k = x.shape
    x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(k // group, m, dtype=torch.float32, device=x.device)
    _act_quant_kernel[(triton.cdiv(m, block_m), k // group)](
        x, q.view(torch.uint8), s, m, K=k, G=group,
        BLOCK_M=block_m, num_warps=4)
    return q, s.t()
