"""Backend selection: ``auto`` picks TensorRT-LLM when an engine for this GPU exists and
``tensorrt_llm`` imports, otherwise the torch backend."""
from __future__ import annotations

from dataclasses import dataclass

from qwen_trt.backends.base import Backend, BackendInfo

BACKENDS = ("auto", "torch", "trtllm")

__all__ = ["Backend", "BackendInfo", "BackendConfig", "BACKENDS", "load_backend", "choose_backend"]


@dataclass(frozen=True)
class BackendConfig:
    """Everything needed to load a backend; the CLI and the app both build one of these."""

    backend: str = "auto"
    model: str | None = None        # folder or hub id (torch; tokenizer source for trtllm)
    engine: str | None = None       # engine folder (trtllm); default engines/<gpu>/
    device: str = "auto"            # torch only
    dtype: str = "auto"             # torch only
    max_seq_len: int | None = None  # torch only: context limit (prompt + reply)
    warmup: bool = True
    fast: str = "auto"              # torch only: compiled fast path; auto = on CUDA, off on CPU

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")


def choose_backend(cfg: BackendConfig) -> str:
    """The concrete backend name ``cfg`` resolves to."""
    if cfg.backend != "auto":
        return cfg.backend
    if cfg.engine:
        return "trtllm"
    try:
        from qwen_trt.backends.trtllm_backend import auto_engine_dir
    except ImportError:
        return "torch"
    return "trtllm" if auto_engine_dir() is not None else "torch"


def load_backend(cfg: BackendConfig) -> Backend:
    name = choose_backend(cfg)
    if name == "trtllm":
        from qwen_trt.backends.trtllm_backend import TrtllmBackend

        return TrtllmBackend.load(engine=cfg.engine, model=cfg.model, warmup=cfg.warmup)
    from qwen_trt.backends.fast_backend import FastBackend, use_fast
    from qwen_trt.backends.torch_backend import TorchBackend, pick_device

    if use_fast(cfg.fast, pick_device(cfg.device)):
        return FastBackend.load(cfg.model, device=cfg.device, dtype=cfg.dtype,
                                max_seq_len=cfg.max_seq_len, warmup=cfg.warmup)
    return TorchBackend.load(cfg.model, device=cfg.device, dtype=cfg.dtype,
                             max_seq_len=cfg.max_seq_len, warmup=cfg.warmup)
