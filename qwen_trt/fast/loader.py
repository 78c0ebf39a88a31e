"""Build a :class:`FastDecoder` from a checkpoint folder, an HF state dict, or random weights."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qwen_trt.errors import ModelSourceError
from qwen_trt.fast.options import options
from qwen_trt.fast.model.config import FastConfig
from qwen_trt.fast.step.decoder import FastDecoder
from qwen_trt.fast.model.model import Qwen3Fast
from qwen_trt.fast.model.qformats import INT4_GROUP, METHODS, QuantSpec, group_for
from qwen_trt.fast.model.weights import checkpoint_quant, init_random, load_safetensors, load_state_dict

FP8_PREFILL_MODES = ("auto", "dequant", "tensorcore")


def build_model(cfg: FastConfig, *, max_seq_len: int, dtype: torch.dtype,
                device: str | torch.device, quant: QuantSpec | None = None) -> Qwen3Fast:
    """An empty model (uninitialised weights, zeroed cache) directly on ``device``."""
    max_seq_len = min(max_seq_len, cfg.max_position_embeddings)
    return Qwen3Fast(cfg, max_seq_len, dtype, device, quant)


def resolve_quant(weights: str | Path | dict | None, quantization: str = "auto") -> QuantSpec:
    """How the projections are held: the checkpoint's format (``auto``), or ``none`` / ``fp8``
    / ``int4`` -- a bf16 checkpoint is quantized as it loads (INT4 by round to nearest); a
    quantized one may only be dequantized (``none``), never re-quantized."""
    if quantization not in ("auto", *METHODS):
        raise ModelSourceError(f"--quantization {quantization!r}: use auto, "
                               f"{', '.join(METHODS)}")
    ck = checkpoint_quant(weights) if isinstance(weights, (str, Path)) else None
    have = ck.method if ck else "none"
    if quantization == "auto":
        return ck.spec() if ck else QuantSpec()
    if have != "none" and quantization not in ("none", have):
        raise ModelSourceError(f"the checkpoint is {have} ({ck.layout}); --quantization "
                               f"{quantization} would quantize it twice: use auto or none")
    if quantization == have and ck is not None:
        return ck.spec()
    return QuantSpec(quantization)


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether the GPU has FP8 tensor cores (compute capability 8.9+);
    ``QWEN_TRT_FP8_TENSOR_CORES=0`` says no (to exercise the fallback anywhere)."""
    if not options().fp8_tensor_cores or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_notes(device: torch.device, mode: str | None = None) -> list[str]:
    """What an FP8 model runs on, as notes; ``mode`` (``QWEN_TRT_FP8_PREFILL``): ``auto`` /
    ``dequant`` (prefill dequantizes, then bf16 GEMMs) or ``tensorcore``, which raises a
    one-line error on a GPU without FP8 tensor cores. Decode always runs the W8A16 kernels.
    Whether the tensor-core prefill is then used is :func:`setup_fp8_prefill`'s."""
    mode = mode or options().fp8_prefill
    if mode not in FP8_PREFILL_MODES:
        raise ModelSourceError(f"QWEN_TRT_FP8_PREFILL={mode!r}: use "
                               f"{', '.join(FP8_PREFILL_MODES)}")
    has_tc = fp8_tensor_cores(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    if mode == "tensorcore" and not has_tc:
        raise ModelSourceError(f"FP8 tensor-core prefill needs FP8 tensor cores (compute "
                               f"capability 8.9+), which {where} lacks: unset "
                               "QWEN_TRT_FP8_PREFILL to use the W8A16 kernels")
    notes = []
    if not has_tc:
        notes.append(f"fp8 weights on {where} without FP8 tensor cores: W8A16 kernels "
                     "(dequantized in registers), prefill dequantizes then runs bf16 GEMMs")
    return notes


def check_fp8_prefill(device: torch.device) -> str | None:
    """The FP8 tensor-core prefill (:func:`~qwen_trt.fast.kernels.linear.fp8_scaled_linear`) on
    this GPU against the dequantized weights: None, or the problem in one line (cuBLAS's
    block-scaled FP8 GEMM needs Hopper and CUDA 12.9+)."""
    from qwen_trt.fast.model.qformats import Fp8Linear, fp8_quantize
    from qwen_trt.fast.kernels.linear import fp8_scaled_linear

    try:
        g = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(256, 512, device=device, generator=g, dtype=torch.bfloat16) * 0.02
        q, s = fp8_quantize(w)
        lin = Fp8Linear(q, s, (128, 128)).to(device)
        x = torch.randn(37, 512, device=device, generator=g, dtype=torch.bfloat16)
        got = fp8_scaled_linear(x, lin).float()
        ref = F.linear(x, lin.dequantize(torch.bfloat16)).float()
        err = ((got - ref).norm() / ref.norm()).item()
    except Exception as e:  # noqa: BLE001 - one line, then the dequantizing prefill
        return f"fp8 tensor-core prefill unavailable ({type(e).__name__}: {str(e)[:160]})"
    if not err < 0.1:
        return f"fp8 tensor-core prefill disagrees with the dequantized weights ({err:.3f})"
    return None


def setup_fp8_prefill(model, mode: str | None = None) -> list[str]:
    """Mark ``model``'s FP8 projections for the tensor-core prefill where it applies: on
    Hopper (compute capability 9.0, cuBLAS's block-scaled recipe) once its self-check passed.
    ``auto`` (the default: on the H200 the first token at 512 tokens is 7.7 ms on tensor
    cores against 11.0 ms dequantizing, ``scripts/device.sh quant``) falls back to the
    dequantizing prefill elsewhere, with a note when the check fails; ``tensorcore`` makes
    that a one-line error; ``dequant`` never marks. Returns notes."""
    from qwen_trt.fast.compile_cache import run_check
    from qwen_trt.fast.model.qformats import Fp8Linear, fp8_tensor_core_ok

    mode = mode or options().fp8_prefill
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    dev = model.device
    if not fp8 or mode == "dequant" or not fp8_tensor_cores(dev):
        return []
    where = torch.cuda.get_device_name(dev)
    if torch.cuda.get_device_capability(dev) != (9, 0):
        if mode == "tensorcore":
            raise ModelSourceError(f"FP8 tensor-core prefill runs cuBLAS's block-scaled FP8 "
                                   f"GEMM, built for Hopper (compute capability 9.0), not "
                                   f"{where}: unset QWEN_TRT_FP8_PREFILL")
        return []
    problem = run_check("fp8_prefill", lambda: check_fp8_prefill(dev))
    if problem:
        if mode == "tensorcore":
            raise ModelSourceError(problem + ": unset QWEN_TRT_FP8_PREFILL")
        return [problem + "; prefill dequantizes then runs bf16 GEMMs"]
    used = 0
    for m in fp8:
        m.tensor_cores = fp8_tensor_core_ok(m)
        used += m.tensor_cores
    return [] if used == len(fp8) else [f"fp8 tensor-core prefill for {used} of {len(fp8)} "
                                        "projections (the rest: N not a multiple of 128 "
                                        "or K not of 512)"]


def load_fast_decoder(cfg: FastConfig, *, weights: str | Path | dict | None, max_seq_len: int,
                     dtype: torch.dtype, device: str | torch.device, seed: int = 0,
                     compile: bool | None = None, graphs: bool | None = None,
                     warmup: bool = True, kernels: str = "auto",
                     quantization: str = "auto") -> FastDecoder:
    """``weights``: a checkpoint folder, an HF state dict, or None for random weights.
    ``kernels``: decode with the fused Triton kernels (``"triton"``), the compiled PyTorch ops
    (``"torch"``), or ``"auto"`` (Triton on CUDA when its self-check passes).
    ``quantization``: see :func:`resolve_quant`."""
    quant = resolve_quant(weights, quantization)
    if quant.method == "int4" and quantization == "int4" and quant.group == INT4_GROUP:
        quant = QuantSpec("int4", group=group_for([cfg.hidden, cfg.intermediate, cfg.q_size]))
    notes = fp8_notes(torch.device(device)) if quant.method == "fp8" else []
    t = time.perf_counter()
    model = build_model(cfg, max_seq_len=max_seq_len, dtype=dtype, device=device, quant=quant)
    if weights is None:
        init_random(model, seed=seed)
    elif isinstance(weights, dict):
        load_state_dict(model, weights)
    else:
        load_safetensors(model, weights)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    t1 = time.perf_counter()
    if quant.method == "fp8":
        notes += setup_fp8_prefill(model)
    decoder = FastDecoder(model, compile=compile, graphs=graphs, kernels=kernels)
    decoder.stats.load_s = round(t1 - t, 3)
    decoder.stats.checks_s = round(time.perf_counter() - t1, 3)
    decoder.stats.notes[:0] = notes
    report_fallbacks(decoder)
    if warmup:
        decoder.warmup()
    return decoder


def report_fallbacks(decoder: FastDecoder) -> None:
    """Say on stderr when a self-check made the decoder fall back to slower code."""
    for note in decoder.stats.notes:
        print(f"qwen-trt fast path: {note}", file=sys.stderr)
