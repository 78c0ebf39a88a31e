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
* :func:`qbgemm` -- 2..64 rows, the fusions of :func:`qwen_trt.fast.bgemm.bgemm`, for FP8,
  INT4 and dense weights: each program multiplies all M rows with a ``BLOCK_N``-row strip over
  its share of K (split-K: ``SPLIT`` programs per strip write float32 partials that one small
  kernel sums and finishes), one scale block / group per step with ``tl.dot``: FP8 values are
  exact in bf16 and the block's scale multiplies the float32 product; INT4 runs one 16-column
  dot per nibble position (the columns ``8c + i`` of the group), so the packed words are never
  reshaped, and applies ``s * (dot - z * sum(x))`` per group.
* :func:`dequantize` -- the whole matrix back to the model dtype (prefill: dequantize, then
  the bf16 GEMM); :func:`act_quant` -- the FP8 tensor-core prefill's activations.

This module holds the entry points, :class:`QConfig` and the tables; the kernels are in
:mod:`~qwen_trt.fast.kernels.qkernels_fp8`, :mod:`~qwen_trt.fast.kernels.qkernels_int4` (batch 1),
:mod:`~qwen_trt.fast.kernels.qkernels_gemm` (the GEMM, dequantize, activation quantization) and
:mod:`~qwen_trt.fast.kernels.qkernel_parts` (the pieces the GEMVs share). The sweep's
tensor-core GEMV (``QConfig(dot=True)``, measured slower, no table entry) is
:mod:`qwen_trt.bench.qkernel_forms`.

``gemv``/``bgemm`` call these when handed a :class:`~qwen_trt.fast.model.qformats.PackedLinear`. INT4
values of a row are 8 to an int32 word (column ``8j + i`` in bits ``4i``). Both kernels compute
on the exact float32 dequantized weights (the reference rounds them to the model dtype first:
the results agree to that rounding).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from qwen_trt.fast.kernels.pdl import launch_kwargs, pdl_enabled
from qwen_trt.fast.model.qformats import Fp8Linear, Int4Linear, PackedLinear

try:
    import triton
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from qwen_trt.fast.kernels.qkernels_fp8 import _f8w_gemv_kernel, _fp8_gemv_kernel
    from qwen_trt.fast.kernels.qkernels_gemm import (_act_quant_kernel, _dequant_kernel,
                                                     _mm_finish_kernel, _mm_kernel)
    from qwen_trt.fast.kernels.qkernels_int4 import _i4_gemv_kernel


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
    dot: bool = False     # GEMV: the sweep's tensor-core form (qwen_trt.bench.qkernel_forms,
                          # not run by qgemv): ``block_n`` rows x ``bk`` columns a pipeline
                          # stage, ``stages`` in flight (Triton's software pipelining),
                          # ``split`` programs along K; measured slower than the table's
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


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, n_blocks: int, cfg: QConfig) -> int:
    if device.type != "cuda":            # the interpreter: a few programs, each looping
        return min(n_blocks, cfg.programs or 3)
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return min(n_blocks, cfg.programs or sms * cfg.ctas_per_sm)


DOT_ELSEWHERE = ("QConfig(dot=True) is the sweep's tensor-core GEMV, not qgemv's: "
                 "qwen_trt.bench.qkernel_forms.dq_gemv")


def _gemv_plan(fmt: int, n: int, k: int, ks: int, sk: int, sn: int, cfg: QConfig, *,
               norm: bool, residual: bool, gate_up: bool, pdl: bool, grid: int, cuda: bool):
    """(kernel, constexpr arguments) of one batch-1 launch (also what
    ``scripts/qkernel_sass.py`` compiles)."""
    if cfg.dot:
        raise ValueError(DOT_ELSEWHERE)
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
        raise ValueError(DOT_ELSEWHERE)
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
