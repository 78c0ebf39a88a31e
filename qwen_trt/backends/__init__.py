"""Backend selection: ``auto`` picks TensorRT-LLM when an engine for this GPU exists and
``tensorrt_llm`` imports, otherwise the torch backend."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from qwen_trt import settings
from qwen_trt.backends.base import Backend, BackendInfo
from qwen_trt.errors import ConfigError

BACKENDS = ("auto", "torch", "trtllm", "openai")
DTYPES = ("auto", "float32", "bfloat16", "float16")
FAST_MODES = ("auto", "on", "off")
QUANTIZATIONS = ("auto", "none", "fp8", "int4")   # fast path weight formats
SPECULATIVE = ("off", "ngram", "eagle3:PATH")     # fast path speculative decoding
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
MIN_MAX_SEQ_LEN = 32   # room for the chat template, a short message and a reply

__all__ = ["Backend", "BackendInfo", "BackendConfig", "BACKENDS", "DTYPES", "FAST_MODES",
           "load_backend", "choose_backend"]


MAX_MAX_BATCH = 256   # the largest decode-graph bucket worth capturing for a 4B model on one GPU
DEFAULT_WATCHDOG_S = settings.declared("QWEN_TRT_WATCHDOG_S").default   # 30 s, then restart


@dataclass(frozen=True)
class BackendConfig:
    """Everything needed to load a backend; the CLI and the app both build one of these
    (:func:`qwen_trt.options.config_from`). Every value is checked here, once, and a bad one
    raises :class:`ConfigError` with one line naming the option and its variable."""

    backend: str = "auto"
    model: str | None = None        # folder or hub id (torch, trtllm LLM API; engine tokenizer)
    engine: str | None = None       # engine folder (trtllm); default engines/<gpu>/
    device: str = "auto"            # torch only
    dtype: str = "auto"             # torch only
    max_seq_len: int | None = None  # torch, trtllm LLM API path: context limit (prompt + reply)
    warmup: bool = True
    fast: str = "auto"              # torch only: compiled fast path; auto = on CUDA, off on CPU
    max_batch: int | None = None    # fast path: continuous-batching width; 1 = batch-1 decoder
    base_url: str | None = None     # openai only: an OpenAI-compatible server (.../v1)
    api_key: str | None = None      # openai: the key sent; qwen-trt serve: the key required
    watchdog_s: float = DEFAULT_WATCHDOG_S  # engine process: no progress this long -> restart
    quantization: str = "auto"      # fast path: weights as the checkpoint has them, or
                                    # fp8 / int4 quantized at load, or none (dequantized)
    cache_dir: str | None = None    # fast path on CUDA: compile/autotune cache root ("off": none)
    speculative: str = "off"        # fast path: off | ngram
    num_speculative_tokens: str = "auto"   # fast path: auto | 1..8 draft tokens a step

    def __post_init__(self) -> None:
        for what, flag, value, allowed in (("backend", "backend", self.backend, BACKENDS),
                                           ("dtype", "dtype", self.dtype, DTYPES),
                                           ("fast mode", "fast", self.fast, FAST_MODES),
                                           ("quantization", "quantization", self.quantization,
                                            QUANTIZATIONS)):
            if value not in allowed:
                raise ConfigError(f"Unknown {what} '{value}' ({_where(flag)}): "
                                  f"use one of {', '.join(allowed)}.")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"Unknown device '{self.device}' ({_where('device')}): "
                              f"use auto, cpu, cuda or cuda:N.")
        n = self.max_seq_len
        if n is not None and (type(n) is not int or n < MIN_MAX_SEQ_LEN):
            raise ConfigError(f"{_where('max-seq-len')} must be a whole number of tokens >= "
                              f"{MIN_MAX_SEQ_LEN} (the chat template alone takes about 10), "
                              f"got '{n}'.")
        b = self.max_batch
        if b is not None and (type(b) is not int or not 1 <= b <= MAX_MAX_BATCH):
            raise ConfigError(f"{_where('max-batch')} must be a whole number from 1 to "
                              f"{MAX_MAX_BATCH}, got '{b}'.")
        w = self.watchdog_s
        if (isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)
                or w < 0):
            raise ConfigError(f"{_where('watchdog-s')} must be a number of seconds >= 0 "
                              f"(0 turns the watchdog off), got '{w}'.")
        method, _, draft = str(self.speculative).partition(":")
        if method not in ("off", "ngram", "eagle3") or (method == "eagle3") != bool(draft):
            raise ConfigError(f"Unknown speculative method '{self.speculative}' "
                              f"({_where('speculative')}): use one of {', '.join(SPECULATIVE)}.")
        if method == "eagle3" and not os.path.isdir(draft):
            raise ConfigError(f"EAGLE-3 draft folder '{draft}' ({_where('speculative')}) does "
                              "not exist.")
        k = self.num_speculative_tokens
        if k != "auto" and not (isinstance(k, str) and k.isdigit() and 1 <= int(k) <= 8):
            raise ConfigError(f"{_where('num-speculative-tokens')} must be auto or a whole "
                              f"number from 1 to 8, got '{k}'.")
        if self.backend == "openai" and not self.base_url:
            raise ConfigError(f"--backend openai needs {_where('base-url')}, e.g. "
                              "http://127.0.0.1:8000/v1.")


def _where(flag: str) -> str:
    """Where a backend option comes from, for error messages: the flag and its variable."""
    return f"--{flag} / QWEN_TRT_{flag.upper().replace('-', '_')}"


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
    engine = auto_engine_dir()
    if engine is None:
        return "torch"
    if cfg.model and not engine_built_from(engine, cfg.model):
        return "torch"   # the user named another model: serve that one, not the engine
    return "trtllm"


def engine_built_from(engine_dir, model: str) -> bool:
    """Whether the engine's manifest names ``model`` (hub id, or the same folder) as its source."""
    import json
    from pathlib import Path

    try:
        src = json.loads((Path(engine_dir) / "manifest.json").read_text())["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not isinstance(src, dict):        # a broken manifest: not this model's engine
        return False
    if model in (src.get("source"), src.get("path")):
        return True
    local = Path(model).expanduser()
    return local.is_dir() and str(local.resolve()) == str(Path(src.get("path", "")).resolve())


def load_backend(cfg: BackendConfig, *, for_runner: bool = False) -> Backend:
    """``for_runner``: the caller will serve the fast path through its continuous-batching
    runner (``qwen_trt.serving.scheduler.batch_runner_for``), so the batch-1 decoder's warm-up is skipped
    (:meth:`FastBackend.load`); other backends ignore it."""
    name = choose_backend(cfg)
    if name == "openai":
        raise ConfigError("The openai backend streams chats, not token ids: start it with "
                          "qwen_trt.serving.service.start_service_for().")
    if name == "trtllm":
        from qwen_trt.backends.trtllm import load_trtllm

        return load_trtllm(engine=cfg.engine, model=cfg.model, warmup=cfg.warmup,
                           max_seq_len=cfg.max_seq_len)
    from qwen_trt.backends.fast_backend import FastBackend, use_fast
    from qwen_trt.backends.torch_backend import TorchBackend, pick_device

    if use_fast(cfg.fast, pick_device(cfg.device)):
        return FastBackend.load(cfg.model, device=cfg.device, dtype=cfg.dtype,
                                max_seq_len=cfg.max_seq_len, warmup=cfg.warmup,
                                for_runner=for_runner, quantization=cfg.quantization,
                                cache_dir=cfg.cache_dir, max_batch=cfg.max_batch)
    if cfg.quantization in ("fp8", "int4"):
        raise ConfigError(f"{_where('quantization')} {cfg.quantization} needs the fast path "
                          "(--fast on, or auto on CUDA); the HF reference path loads bf16 only.")
    return TorchBackend.load(cfg.model, device=cfg.device, dtype=cfg.dtype,
                             max_seq_len=cfg.max_seq_len, warmup=cfg.warmup)
