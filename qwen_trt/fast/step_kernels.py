"""The elementwise pieces of a batched step that prefills, as two small Triton kernels for any row
count: the steps' projections stay cuBLAS, and these do the rest without ``torch.compile``.

* :func:`rms_norm_rows` -- each row's RMSNorm (``fast/reference.py``'s rounding: float32, cast,
  times the weight); with ``residual``, first ``h = x + residual`` (rounded to the dtype), and
  both ``h`` and ``rms_norm(h)`` come back;
* :func:`silu_mul_rows` -- ``silu(gate) * up`` of a ``[rows, 2 I]`` gate/up projection
  (:func:`~qwen_trt.fast.kernel_parts.silu_mul`'s rounding).

With these the step has the kernels inductor makes of ``batched._pre_attention`` /
``_post_attention`` (one norm; add + norm, SiLU·up, the last add) while the engine never imports
dynamo: about 2 s of its start, and the compiled pieces' tracing on every start
(``KernelOptions.step_triton``, ``QWEN_TRT_STEP_TRITON=1``).
"""
from __future__ import annotations

import torch

from qwen_trt.fast.kernel_parts import silu_mul

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs: nothing here is launched
    triton = None

SILU_BLOCK = 1024        # columns of the activation per program


if triton is not None:
    @triton.jit
    def _rms_norm_rows_kernel(x_ptr, res_ptr, w_ptr, h_ptr, out_ptr, eps, K: tl.constexpr,
                              KP: tl.constexpr, ADD: tl.constexpr):
        """Row ``program_id(0)``: ``out = w * (h * rstd(h)).to(dt)`` with ``h = x`` (or
        ``x + res`` rounded to dt, also stored into ``h_ptr``)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, KP)
        ok = cols < K
        x = tl.load(x_ptr + row * K + cols, mask=ok, other=0.0)
        dt = x.dtype
        if ADD:
            x = (x.to(tl.float32) + tl.load(res_ptr + row * K + cols, mask=ok,
                                              other=0.0).to(tl.float32)).to(dt)
            tl.store(h_ptr + row * K + cols, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        n = (xf * rstd).to(dt)
        tl.store(out_ptr + row * K + cols, (w.to(tl.float32) * n.to(tl.float32)).to(dt),
                 mask=ok)

    @triton.jit
    def _silu_mul_rows_kernel(gu_ptr, out_ptr, I: tl.constexpr, BLOCK: tl.constexpr):
        """Row ``program_id(0)``, columns ``program_id(1) * BLOCK ..`` of ``silu(gate) * up``
        from ``gu [rows, 2 I]`` (gate first)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        gate = tl.load(gu_ptr + row * 2 * I + cols, mask=ok, other=0.0)
        up = tl.load(gu_ptr + row * 2 * I + I + cols, mask=ok, other=0.0)
        tl.store(out_ptr + row * I + cols, silu_mul(gate, up, gate.dtype), mask=ok)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None):
    """``rms_norm(x)`` of ``x [rows, K]`` (contiguous); with ``residual``, ``(h, rms_norm(h))``
    for ``h = x + residual``."""
    rows, k = x.shape
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else out
    if rows:
        _rms_norm_rows_kernel[(rows,)](x, residual if residual is not None else x, weight, h,
                                       out, eps, K=k, KP=triton.next_power_of_2(k),
                                       ADD=residual is not None, num_warps=4)
    return (h, out) if residual is not None else out


def silu_mul_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [rows, 2 I]`` (contiguous) -> ``[rows, I]``."""
    rows, two_i = gate_up.shape
    i = two_i // 2
    out = torch.empty(rows, i, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_mul_rows_kernel[(rows, triton.cdiv(i, SILU_BLOCK))](gate_up, out, I=i,
                                                                  BLOCK=SILU_BLOCK, num_warps=4)
    return out


def pre_attention(x: torch.Tensor, ln: torch.Tensor, w: torch.Tensor, eps: float):
    """:func:`~qwen_trt.fast.batched._pre_attention` with :func:`rms_norm_rows`."""
    return torch.nn.functional.linear(rms_norm_rows(x, ln, eps), w)


def post_attention(x: torch.Tensor, o: torch.Tensor, wo: torch.Tensor, ln: torch.Tensor,
                   w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float):
    """:func:`~qwen_trt.fast.batched._post_attention`: the o projection, the residual add fused
    into the norm, the gate/up projection, SiLU·up, the down projection and its residual."""
    F = torch.nn.functional
    h, n = rms_norm_rows(x, ln, eps, residual=F.linear(o, wo))
    return h + F.linear(silu_mul_rows(F.linear(n, w_gate_up)), w_down)
