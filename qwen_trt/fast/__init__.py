"""The fast path: a compact Qwen3 model with a static KV cache, compiled and replayed as CUDA
graphs on the GPU (see docs/fast-path.md). :func:`load_fast_decoder` is the one entry point."""
from __future__ import annotations

from qwen_trt.fast.model.config import QWEN3_4B, SHAPES, TINY, FastConfig
from qwen_trt.fast.step.decoder import DecoderStats, FastDecoder
from qwen_trt.fast.loader import build_model, load_fast_decoder
from qwen_trt.fast.model.model import Qwen3Fast

__all__ = ["FastConfig", "QWEN3_4B", "TINY", "SHAPES", "FastDecoder", "DecoderStats", "Qwen3Fast",
           "build_model", "load_fast_decoder"]
