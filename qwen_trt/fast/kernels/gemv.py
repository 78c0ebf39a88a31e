"""Batch-1 projections for the decode step: Triton GEMVs with the neighbouring small ops fused in.

A decode step multiplies one activation row by each weight matrix, so it is bound by how fast
the weights stream from memory. These kernels read each weight row exactly once with wide loads
spread over every SM, and fold the small ops around a projection into it:

* ``gemv(w, x)``                          ``y = x @ w.T``
* ``gemv(w, x, ln=g, eps=e)``             RMSNorm prologue: ``y = rms_norm(x, g) @ w.T`` (each
  program recomputes the norm statistics from ``x``, which sits in L2)
* ``gemv(w, x, residual=r)``              residual epilogue: ``y = r + x @ w.T``
* ``gemv(w, x, ln=g, gate_up=True)``      ``w`` is ``[gate; up]`` (``2I x K``): the epilogue is
  ``silu(gate) * up`` (``y`` has ``I`` entries)

Rounding follows the unfused PyTorch ops step by step (RMSNorm in float32 then cast, the weight
product in the model dtype, the projection rounded before the residual add or the activation), so
the only difference from ``F.linear`` is the order of the float32 accumulation.

On Hopper and newer the kernels use programmatic dependent launch (:mod:`qwen_trt.fast.kernels.pdl`):
a program loads its first weight columns, then waits for the previous kernel, so consecutive
projections overlap their ramp-up with the previous kernel's tail.

``x`` is ``[K]`` (or ``[1, K]``), the result is ``[N]``. Block sizes come from :func:`config_for`
(measured on an H200 by ``python -m qwen_trt.bench.kernel_bench --sweep``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qwen_trt.fast.kernels.kernel_parts import silu_mul, store_rows
from qwen_trt.fast.options import options
from qwen_trt.fast.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_kwargs, pdl_enabled
from qwen_trt.fast.kernels.linear import dense
from qwen_trt.fast.model.reference import rms_norm

try:  # Triton comes with CUDA builds of torch; CPU-only installs lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 4       # output rows per program (per row block, when persistent)
    block_k: int = 512     # columns per load after the prefetched ones (power of two)
    warps: int = 4
    pre_k: int = 8192      # at most this many columns are loaded before the PDL wait
    ctas_per_sm: int = 0   # > 0: persistent kernel, this many programs per SM, each looping
                           # over row blocks with the next block's loads in flight; it loads
                           # whole rows, so block_k and pre_k do not apply to it
    programs: int = 0      # persistent: exactly this many programs instead (e.g. a divisor
                           # of the row blocks, so the last wave is full)


def config_for(n: int, k: int, gate_up: bool = False) -> GemvConfig:
    """Block sizes for an ``n x k`` projection: the fastest in a sweep on an H200
    (``python -m qwen_trt.bench.kernel_bench --sweep``; µs per call with PDL; see
    docs/benchmarks.md). ``QWEN_TRT_GEMV_<N>x<K>=block_n:warps:ctas_per_sm`` overrides the
    persistent configuration of one shape (for sweeps inside the decode step)."""
    override = options().gemv.get((n, k))
    if override:
        bn, warps, ctas = override
        return GemvConfig(block_n=bn, warps=warps, ctas_per_sm=ctas)
    if n >= 65536:          # LM head, 778 MB: 178 µs, 4.37 TB/s
        return GemvConfig(block_n=8, block_k=512, warps=4, pre_k=2048)
    if gate_up:             # 99.6 MB: 26.5 µs, 3.75 TB/s
        return GemvConfig(block_n=1, warps=8, ctas_per_sm=4)
    if k >= 8192:           # down, 49.8 MB: 13.3 µs, 3.75 TB/s
        return GemvConfig(block_n=2, warps=4, ctas_per_sm=2)
    # qkv 31.5 MB: 9.2 µs; o 21 MB: 6.4 µs alone with 2:8:4. Inside the decode step (PDL,
    # `profile --variants`, same run) qkv 4:8:2 and o 1:4:8 measured 0.4 and 0.3 % faster.
    if n < k:               # o
        return GemvConfig(block_n=1, warps=4, ctas_per_sm=8)
    return GemvConfig(block_n=4, warps=8, ctas_per_sm=2)   # qkv


if triton is not None:
    @triton.jit
    def _gemv_kernel(w_ptr, x_ptr, out_ptr, ln_ptr, res_ptr, eps,
                     N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRE_K: tl.constexpr, NORM: tl.constexpr,
                     RESIDUAL: tl.constexpr, GATE_UP: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        dt = x_ptr.dtype.element_ty
        # 1. Weights are constant: issue the loads of the first PRE_K columns before waiting
        #    for the previous kernel (PDL), so this kernel's memory stream starts while that
        #    one drains.
        pk = tl.arange(0, PRE_K)
        w_pre = tl.load(w_ptr + rows[:, None] * K + pk[None, :], mask=row_ok[:, None], other=0.0)
        if GATE_UP:
            w2_pre = tl.load(w_ptr + N * K + rows[:, None] * K + pk[None, :],
                             mask=row_ok[:, None], other=0.0)
        if NORM:
            g_pre = tl.load(ln_ptr + pk)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()   # everything below may read what the previous kernel wrote
        # 2. RMSNorm statistics of x (each program reads x from L2)
        cols = tl.arange(0, BLOCK_K)
        rstd = 0.0
        if NORM:
            x0 = tl.load(x_ptr + pk).to(tl.float32)
            ss = tl.sum(x0 * x0, 0)
            for k0 in tl.static_range(PRE_K, K, BLOCK_K):
                kk = k0 + cols
                xv = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                ss += tl.sum(xv * xv, 0)
            rstd = tl.rsqrt(ss / K + eps)
        # 3. the prefetched columns, then the rest in BLOCK_K chunks. Products accumulate
        #    elementwise and are reduced once at the end, so the chunk loads do not wait on
        #    one another.
        xv = tl.load(x_ptr + pk)
        if NORM:   # weight * (x * rstd).to(dtype), like the unfused RMSNorm
            xv = (g_pre.to(tl.float32) * (xv.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)
        xf = xv.to(tl.float32)[None, :]
        acc_pre = w_pre.to(tl.float32) * xf
        if GATE_UP:
            acc2_pre = w2_pre.to(tl.float32) * xf
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.static_range(PRE_K, K, BLOCK_K):
            kk = k0 + cols
            k_ok = kk < K
            xv = tl.load(x_ptr + kk, mask=k_ok, other=0.0)
            if NORM:
                g = tl.load(ln_ptr + kk, mask=k_ok, other=0.0)
                xv = (g.to(tl.float32) * (xv.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)
            xf = xv.to(tl.float32)[None, :]
            offs = rows[:, None] * K + kk[None, :]
            mask = row_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptr + offs, mask=mask, other=0.0)
            acc += w.to(tl.float32) * xf
            if GATE_UP:
                w2 = tl.load(w_ptr + N * K + offs, mask=mask, other=0.0)
                acc2 += w2.to(tl.float32) * xf
        y_acc = tl.sum(acc_pre, 1) + tl.sum(acc, 1)
        u_acc = y_acc
        if GATE_UP:
            u_acc = tl.sum(acc2_pre, 1) + tl.sum(acc2, 1)
        store_rows(y_acc, u_acc, rows, row_ok, res_ptr, out_ptr, dt, GATE_UP, RESIDUAL)


    @triton.jit
    def _gemv_persistent_kernel(w_ptr, x_ptr, out_ptr, ln_ptr, res_ptr, eps,
                                N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                                BLOCK_N: tl.constexpr, NORM: tl.constexpr,
                                RESIDUAL: tl.constexpr, GATE_UP: tl.constexpr,
                                PDL: tl.constexpr, P: tl.constexpr, EVICT: tl.constexpr = ""):
        """Same function as ``_gemv_kernel``; a fixed grid of programs, each walking row
        blocks ``pid, pid + P, ...`` with whole rows (``KP`` = K rounded up to a power of two)
        and the next block's weights loading while the current one is reduced. ``EVICT``: the
        L2 eviction policy of the weight loads (``"evict_first"``: read once, keep the
        activations and the KV cache in L2 instead)."""
        pid = tl.program_id(0)
        n_blocks: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        iters: tl.constexpr = (n_blocks + P - 1) // P
        dt = x_ptr.dtype.element_ty
        cols = tl.arange(0, KP)
        k_ok = cols < K
        r = tl.arange(0, BLOCK_N)
        rows = pid * BLOCK_N + r
        m = (rows < N)[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=m, other=0.0,
                    eviction_policy=EVICT)
        w2 = w
        if GATE_UP:
            w2 = tl.load(w_ptr + N * K + rows[:, None] * K + cols[None, :], mask=m, other=0.0,
                         eviction_policy=EVICT)
        if NORM:
            g = tl.load(ln_ptr + cols, mask=k_ok, other=0.0)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        xv = tl.load(x_ptr + cols, mask=k_ok, other=0.0)
        if NORM:   # once per program: weight * (x * rstd).to(dtype)
            xf32 = xv.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xf32 * xf32, 0) / K + eps)
            xv = (g.to(tl.float32) * (xf32 * rstd).to(dt).to(tl.float32)).to(dt)
        xf = xv.to(tl.float32)[None, :]
        for it in range(iters):                 # row blocks pid, pid + P, ...
            rows = (pid + it * P) * BLOCK_N + r
            nrows = rows + P * BLOCK_N          # the next block of this program
            nm = (nrows < N)[:, None] & k_ok[None, :]
            w_next = tl.load(w_ptr + nrows[:, None] * K + cols[None, :], mask=nm, other=0.0,
                             eviction_policy=EVICT)
            y = tl.sum(w.to(tl.float32) * xf, 1).to(dt)
            if GATE_UP:
                w2_next = tl.load(w_ptr + N * K + nrows[:, None] * K + cols[None, :], mask=nm,
                                  other=0.0, eviction_policy=EVICT)
                y = silu_mul(y, tl.sum(w2.to(tl.float32) * xf, 1).to(dt), dt)
                w2 = w2_next
            row_ok = rows < N
            if RESIDUAL:
                res = tl.load(res_ptr + rows, mask=row_ok, other=0.0)
                y = (res.to(tl.float32) + y.to(tl.float32)).to(dt)
            tl.store(out_ptr + rows, y, mask=row_ok)
            w = w_next


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pre_k(k: int, cap: int = 8192) -> int:
    """Columns prefetched before the PDL wait: the largest power of two <= k (at most cap)."""
    return min(1 << (k.bit_length() - 1), cap)


def gemv(w: torch.Tensor, x: torch.Tensor, *, ln: torch.Tensor | None = None, eps: float = 0.0,
         residual: torch.Tensor | None = None, gate_up: bool = False,
         config: GemvConfig | None = None) -> torch.Tensor:
    """Triton GEMV with the fusions listed in the module docstring; returns ``[N]``. The
    persistent configurations stream the weights with the evict-first L2 policy. A packed weight
    (FP8, INT4: :mod:`qwen_trt.fast.model.qformats`) runs :func:`qwen_trt.fast.kernels.qkernels.qgemv` instead."""
    if not isinstance(w, torch.Tensor):
        from qwen_trt.fast.kernels.qkernels import qgemv

        return qgemv(w, x, ln=ln, eps=eps, residual=residual, gate_up=gate_up)
    rows, k = w.shape
    n = rows // 2 if gate_up else rows
    x = x.reshape(k)
    if not all(t is None or t.is_contiguous() for t in (w, x, ln, residual)):
        raise ValueError("gemv needs contiguous w, x, ln and residual")
    cfg = config or config_for(n, k, gate_up)
    pk = pre_k(k, cfg.pre_k)
    block_k = min(cfg.block_k, triton.next_power_of_2(k))
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    res = residual.reshape(n) if residual is not None else out
    pdl = pdl_enabled(x.device)
    if (cfg.ctas_per_sm > 0 or cfg.programs > 0) and x.device.type == "cuda":
        sms = _sm_count(x.device.index if x.device.index is not None
                        else torch.cuda.current_device())
        grid = min(triton.cdiv(n, cfg.block_n), cfg.programs or sms * cfg.ctas_per_sm)
        _gemv_persistent_kernel[(grid,)](
            w, x, out, ln if ln is not None else x, res, eps, N=n, K=k,
            KP=triton.next_power_of_2(k), BLOCK_N=cfg.block_n, NORM=ln is not None,
            RESIDUAL=residual is not None, GATE_UP=gate_up, PDL=pdl, P=grid, EVICT="evict_first",
            num_warps=cfg.warps, **launch_kwargs(pdl))
        return out
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        w, x, out, ln if ln is not None else x, res, eps, N=n, K=k, BLOCK_N=cfg.block_n,
        BLOCK_K=block_k, PRE_K=pk, NORM=ln is not None, RESIDUAL=residual is not None,
        GATE_UP=gate_up, PDL=pdl, num_warps=cfg.warps, **launch_kwargs(pdl))
    return out


def gemv_ref(w: torch.Tensor, x: torch.Tensor, *, ln: torch.Tensor | None = None,
             eps: float = 0.0, residual: torch.Tensor | None = None,
             gate_up: bool = False) -> torch.Tensor:
    """The same function with unfused PyTorch ops (the reference in tests and self-checks)."""
    x = x.reshape(1, -1)
    if ln is not None:
        x = rms_norm(x, ln, eps)
    y = F.linear(x, dense(w, x.dtype))
    if gate_up:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    if residual is not None:
        y = residual.reshape(1, -1) + y
    return y.reshape(-1)
