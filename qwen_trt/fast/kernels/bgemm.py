"""Small-batch projections for the batched decode step (2..32 rows): the batch-1 GEMVs of
:mod:`qwen_trt.fast.kernels.gemv` generalised to M rows. Each program reads a ``BLOCK_N``-row strip of
the weight once for all M activation rows (``tl.dot`` with M padded to 16), so the step stays
bound by one pass over the weights, and the small ops are fused like the GEMVs':

* ``bgemm(w, x)``                     ``y = x @ w.T``                 (``x [M, K]``)
* ``bgemm(w, x, residual=r)``         ``y = r + x @ w.T``
* ``bgemm(w, x, gate_up=True)``       ``w = [gate; up]``: ``silu(x @ gate.T) * (x @ up.T)``
* ``rms_rows(x, g, eps)``             RMSNorm of every row (one program per row; the norm is a
  separate tiny kernel here because every program of the projection would otherwise re-read
  all M rows to get their statistics); ``residual=r``: ``h = x + r`` first, both returned
* ``silu_mul_rows(gu)``               ``silu(gate) * up`` of a ``[M, 2 I]`` gate/up projection
  (the cuBLAS steps that prefill: ``batched._post_triton``)

Rounding follows the unfused PyTorch ops (the projection rounded to the model dtype before the
residual add or the activation), as in :mod:`qwen_trt.fast.kernels.gemv`. float32 models use exact
(IEEE) products, not tf32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qwen_trt.fast.kernels.kernel_parts import silu_mul
from qwen_trt.fast.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


@dataclass(frozen=True)
class BgemmConfig:
    block_n: int = 32
    block_k: int = 256
    warps: int = 4
    stages: int = 4


def bgemm_config(n: int, k: int) -> BgemmConfig:
    """Block sizes by shape for non-CUDA runs (the interpreter); on CUDA the kernel is tuned
    per (shape, row bucket) at first use, and the batched model still times the whole step
    against cuBLAS per batch bucket at warm-up and keeps the faster."""
    if n >= 65536:                       # LM head
        return BgemmConfig(block_n=64, block_k=128, warps=4, stages=4)
    if n <= 4096:                        # o / down: few rows, long K: thin strips, more programs
        return BgemmConfig(block_n=16, block_k=256, warps=4, stages=4)
    return BgemmConfig(block_n=32, block_k=256, warps=4, stages=4)


if triton is not None:
    @triton.jit
    def _rms_rows_kernel(x_ptr, g_ptr, out_ptr, res_ptr, h_ptr, eps, K: tl.constexpr,
                         KP: tl.constexpr, PDL: tl.constexpr, ADD: tl.constexpr):
        """Row ``program_id(0)``'s RMSNorm; ``ADD``: of ``h = x + res`` (rounded to the dtype,
        stored to ``h_ptr``)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, KP)
        ok = cols < K
        g = tl.load(g_ptr + cols, mask=ok, other=0.0)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        dt = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * K + cols, mask=ok, other=0.0).to(tl.float32)
        if ADD:
            x = (x + tl.load(res_ptr + row * K + cols, mask=ok, other=0.0).to(tl.float32)).to(dt)
            tl.store(h_ptr + row * K + cols, x, mask=ok)
            x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / K + eps)
        y = (g.to(tl.float32) * (x * rstd).to(dt).to(tl.float32)).to(dt)
        tl.store(out_ptr + row * K + cols, y, mask=ok)

    @triton.jit
    def _silu_mul_rows_kernel(gu_ptr, out_ptr, I: tl.constexpr, BLOCK: tl.constexpr):
        """Row ``program_id(0)``, columns ``program_id(1) * BLOCK ..`` of ``silu(gate) * up``
        from ``gu [M, 2 I]`` (gate first)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        gate = tl.load(gu_ptr + row * 2 * I + cols, mask=ok, other=0.0)
        up = tl.load(gu_ptr + row * 2 * I + I + cols, mask=ok, other=0.0)
        tl.store(out_ptr + row * I + cols, silu_mul(gate, up, gate.dtype), mask=ok)

    @triton.jit
    def _bgemm_kernel(w_ptr, x_ptr, out_ptr, res_ptr, M,
                      N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RESIDUAL: tl.constexpr,
                      GATE_UP: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        rk = tl.arange(0, BLOCK_K)
        dt = x_ptr.dtype.element_ty
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            x = tl.load(x_ptr + rm[:, None] * K + kk[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wm = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=wm, other=0.0)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
            if GATE_UP:
                w2 = tl.load(w_ptr + N * K + rn[:, None] * K + kk[None, :], mask=wm, other=0.0)
                if IEEE:
                    acc2 += tl.dot(x, tl.trans(w2), input_precision="ieee")
                else:
                    acc2 += tl.dot(x, tl.trans(w2))
        y = acc.to(dt)
        if GATE_UP:
            y = silu_mul(y, acc2.to(dt), dt)
        om = m_ok[:, None] & n_ok[None, :]
        offs = rm[:, None] * N + rn[None, :]
        if RESIDUAL:
            r = tl.load(res_ptr + offs, mask=om, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dt)
        tl.store(out_ptr + offs, y, mask=om)


if triton is not None:
    def _quick_bench(fn, quantiles=None, **_):
        return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)

    # Tuned at the first call of each (shape, row bucket): during the decoder's warm-up, before
    # the graph capture. Configs that do not fit in shared memory are skipped by the tuner.
    _TUNE_CONFIGS = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bk, w, st in ((16, 256, 4, 4), (32, 256, 4, 4), (16, 512, 4, 3),
                              (32, 128, 4, 6), (64, 128, 4, 4), (64, 256, 8, 3),
                              (16, 128, 2, 6), (128, 64, 4, 4))]
    _bgemm_tuned = triton.autotune(configs=_TUNE_CONFIGS, key=["N", "K", "BLOCK_M"],
                                   do_bench=_quick_bench)(_bgemm_kernel)


def rms_rows(x: torch.Tensor, g: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm of each row of ``x [M, K]`` (the model's :func:`rms_norm` rounding); with
    ``residual``, ``(h, rms_norm(h))`` for ``h = x + residual`` (rounded to the dtype)."""
    m, k = x.shape
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else out
    if m:
        pdl = pdl_enabled(x.device)
        _rms_rows_kernel[(m,)](x, g, out, residual if residual is not None else x, h, eps,
                               K=k, KP=triton.next_power_of_2(k), PDL=pdl,
                               ADD=residual is not None, num_warps=4, **launch_kwargs(pdl))
    return (h, out) if residual is not None else out


SILU_BLOCK = 1024        # columns of silu_mul_rows' output per program


def silu_mul_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [M, 2 I]`` (contiguous) -> ``[M, I]``, rounded like
    the unfused PyTorch ops."""
    m, two_i = gate_up.shape
    i = two_i // 2
    out = torch.empty(m, i, dtype=gate_up.dtype, device=gate_up.device)
    if m:
        _silu_mul_rows_kernel[(m, triton.cdiv(i, SILU_BLOCK))](gate_up, out, I=i,
                                                               BLOCK=SILU_BLOCK, num_warps=4)
    return out


def bgemm(w: torch.Tensor, x: torch.Tensor, *, residual: torch.Tensor | None = None,
          gate_up: bool = False, config: BgemmConfig | None = None) -> torch.Tensor:
    """``x [M, K]`` (M <= 64) times ``w.T``, with the fusions of the module docstring. A
    packed weight (:mod:`qwen_trt.fast.model.qformats`) runs :func:`qwen_trt.fast.kernels.qkernels.qbgemm`,
    and so does a dense one whose shape and row bucket ``qkernels.GEMM_TABLE`` lists (the
    split-K form, where it measured faster than this kernel)."""
    if not isinstance(w, torch.Tensor):
        from qwen_trt.fast.kernels.qkernels import qbgemm

        return qbgemm(w, x, residual=residual, gate_up=gate_up)
    rows, k = w.shape
    n = rows // 2 if gate_up else rows
    m = x.shape[0]
    if config is None and x.device.type == "cuda":
        from qwen_trt.fast.kernels.qkernels import FMT_DENSE, GEMM_TABLE, qbgemm

        split = GEMM_TABLE.get((FMT_DENSE, n, k, max(16, triton.next_power_of_2(m))))
        if split is not None:       # the split-K GEMM measured faster for this shape
            return qbgemm(w, x, residual=residual, gate_up=gate_up, config=split)
    if not (x.is_contiguous() and w.is_contiguous()) or x.shape[1] != k:
        raise ValueError("bgemm needs contiguous w [N, K] and x [M, K]")
    cfg = config or bgemm_config(n, k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res = residual if residual is not None else out
    if residual is not None and not residual.is_contiguous():
        raise ValueError("bgemm needs a contiguous residual")
    pdl = pdl_enabled(x.device)
    block_m = max(16, triton.next_power_of_2(m))
    if config is None and x.device.type == "cuda":
        _bgemm_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            w, x, out, res, m, N=n, K=k, BLOCK_M=block_m, RESIDUAL=residual is not None,
            GATE_UP=gate_up, IEEE=x.dtype == torch.float32, PDL=pdl, **launch_kwargs(pdl))
        return out
    _bgemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        w, x, out, res, m, N=n, K=k, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=min(cfg.block_k, triton.next_power_of_2(k)),
        RESIDUAL=residual is not None, GATE_UP=gate_up, IEEE=x.dtype == torch.float32,
        PDL=pdl, num_warps=cfg.warps, num_stages=cfg.stages, **launch_kwargs(pdl))
    return out
