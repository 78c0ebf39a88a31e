"""Build a :class:`FastDecoder` from a checkpoint folder, an HF state dict, or random weights."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from qwen_trt.fast.config import FastConfig
from qwen_trt.fast.decoder import FastDecoder
from qwen_trt.fast.model import Qwen3Fast
from qwen_trt.fast.weights import init_random, load_safetensors, load_state_dict


def build_model(cfg: FastConfig, *, max_seq_len: int, dtype: torch.dtype,
                device: str | torch.device) -> Qwen3Fast:
    """An empty model (uninitialised weights, zeroed cache) directly on ``device``."""
    max_seq_len = min(max_seq_len, cfg.max_position_embeddings)
    return Qwen3Fast(cfg, max_seq_len, dtype, device)


def load_fast_decoder(cfg: FastConfig, *, weights: str | Path | dict | None, max_seq_len: int,
                     dtype: torch.dtype, device: str | torch.device, seed: int = 0,
                     compile: bool | None = None, graphs: bool | None = None,
                     warmup: bool = True, kernels: str = "auto") -> FastDecoder:
    """``weights``: a checkpoint folder, an HF state dict, or None for random weights.
    ``kernels``: decode with the fused Triton kernels (``"triton"``), the compiled PyTorch ops
    (``"torch"``), or ``"auto"`` (Triton on CUDA when its self-check passes)."""
    model = build_model(cfg, max_seq_len=max_seq_len, dtype=dtype, device=device)
    if weights is None:
        init_random(model, seed=seed)
    elif isinstance(weights, dict):
        load_state_dict(model, weights)
    else:
        load_safetensors(model, weights)
    decoder = FastDecoder(model, compile=compile, graphs=graphs, kernels=kernels)
    report_fallbacks(decoder)
    if warmup:
        decoder.warmup()
    return decoder


def report_fallbacks(decoder: FastDecoder) -> None:
    """Say on stderr when a self-check made the decoder fall back to slower code."""
    for note in decoder.stats.notes:
        print(f"qwen-trt fast path: {note}", file=sys.stderr)
