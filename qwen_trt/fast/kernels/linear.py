"""Multiplying by a projection of any weight format (:mod:`qwen_trt.fast.model.qformats`):
:func:`dense` gives the weights back in the model dtype (one Triton dequantizing kernel on
CUDA), :func:`linear` multiplies (FP8 tensor cores for a marked :class:`Fp8Linear` with enough
rows), :func:`prefill_weight` says what a prefill's GEMMs take. The formats know nothing of
the kernels; these ops sit above both."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qwen_trt.fast.kernels.qkernels import act_quant, dequantize, triton
from qwen_trt.fast.model.qformats import (Fp8Linear, PackedLinear, Weight, fp8_act_quant)


def dense(w: Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``w`` as a dense ``[N, K]`` tensor; packed formats are dequantized to ``dtype`` (one
    Triton kernel on CUDA, PyTorch ops elsewhere and inside ``torch.compile``)."""
    if isinstance(w, torch.Tensor):
        return w
    dtype = dtype or torch.bfloat16
    if w.device.type == "cuda" and not torch.compiler.is_compiling():
        if triton is not None:   # one Triton kernel
            return dequantize(w, dtype)
    return w.dequantize(dtype)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """``x @ w.T`` for any format: packed weights are dequantized to ``x``'s dtype first,
    except an :class:`Fp8Linear` marked for FP8 tensor-core prefill (:func:`prefill_weight`),
    which multiplies on FP8 tensor cores (:func:`fp8_scaled_linear`) when ``x`` has at least
    :data:`FP8_TC_MIN_ROWS` rows (fewer, e.g. the PyTorch decode, keep bf16 activations)."""
    if (isinstance(w, PackedLinear) and w.tensor_cores
            and x.numel() >= FP8_TC_MIN_ROWS * x.shape[-1]):
        return fp8_scaled_linear(x, w)
    return F.linear(x, dense(w, x.dtype))


def prefill_weight(w: Weight, dtype: torch.dtype) -> Weight:
    """What a prefill's GEMMs take for ``w``: the :class:`Fp8Linear` itself where it is
    marked for FP8 tensor-core prefill (:func:`linear` then runs :func:`fp8_scaled_linear`),
    else the dense weights (dequantized for packed formats)."""
    if isinstance(w, PackedLinear) and w.tensor_cores:
        return w
    return dense(w, dtype)


FP8_TC_MIN_ROWS = 16   # rows from which a marked FP8 projection runs on tensor cores


def fp8_scaled_linear(x: torch.Tensor, w: "Fp8Linear") -> torch.Tensor:
    """``x @ w.T`` on FP8 tensor cores (Hopper, CUDA 12.9+): the activations quantized per
    row and 128 columns (:func:`fp8_act_quant`), the weights as stored with their 128x128
    block scales, through ``torch._scaled_mm``'s block-wise recipe (1x128 for the
    activations, 128x128 for the weights). Layouts it needs (``ScaledBlas.cpp``,
    ``is_blockwise_1x128_scaling`` / ``is_blockwise_128x128_scaling``): the activation
    scales outer-dimension-major (``[M, K/128]`` with stride ``(1, M)``), the weight scales'
    transpose ``[N/128, K/128]`` row-major with 16-byte aligned rows (so K/128 a multiple of 4:
    :func:`fp8_tensor_core_ok`), rows of ``x`` padded to a multiple of 4."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    pad = (-m) % 4
    if pad:
        x2 = F.pad(x2, (0, 0, 0, pad))
    if x2.is_cuda and not torch.compiler.is_compiling():
        q, sx = act_quant(x2)
    else:                                   # torch.compile fuses these (the batch-1 prefill)
        q, sx = fp8_act_quant(x2)
        sx = sx.t().contiguous().t()
    out = torch._scaled_mm(q, w.weight.t(), scale_a=sx,
                           scale_b=w.scale.float().contiguous().t(), out_dtype=x.dtype)
    return out[:m].reshape(*lead, w.n)
