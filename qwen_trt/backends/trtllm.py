"""The ``trtllm`` backend's two paths, chosen in one place: a built TensorRT-LLM engine
(:class:`~qwen_trt.backends.trtllm_backend.TrtllmBackend`, the C++ executor) when an engine folder
is given or found for this GPU, else the checkpoint through TensorRT-LLM's LLM API
(:class:`~qwen_trt.backends.trtllm_llmapi.LlmApiBackend`, the only path of a tensorrt_llm
released after 1.3.0rc20). The LLM API path builds on the engine path's request handling, so the
choice lives above both modules."""
from __future__ import annotations

import logging
from pathlib import Path

from qwen_trt.backends.trtllm_backend import TrtllmBackend, default_engines_dir
from qwen_trt.backends.trtllm_llmapi import LlmApiBackend

log = logging.getLogger(__name__)


def load_trtllm(engine: str | None = None, model: str | None = None, *, warmup: bool = True,
                max_seq_len: int | None = None) -> TrtllmBackend:
    """The engine path when an engine folder is given (``engine``) or found for this GPU under
    engines/; otherwise the LLM API path on the checkpoint ``model``."""
    from qwen_trt.engine.env import (NO_ENGINE_BUILDER, NoEngineBuilderError,
                                     has_engine_backend, library_versions, require_trtllm)
    from qwen_trt.engine.gpu import require_gpu
    from qwen_trt.engine.profiles import load_all

    trtllm = require_trtllm("engine" if engine is not None else "llmapi")
    version = str(getattr(trtllm, "__version__", "unknown"))
    engines_ok = version == "unknown" or has_engine_backend(version)
    if engine is not None and not engines_ok:   # require_trtllm("engine") said so already
        raise NoEngineBuilderError(NO_ENGINE_BUILDER.format(version=version) + ".")
    gpu = require_gpu()
    engine_dir = None
    if engine is not None:
        engine_dir = Path(engine)
    elif engines_ok:
        engine_dir = TrtllmBackend.find_engine(gpu, library_versions(), load_all)
    if engine_dir is None:
        if engines_ok:
            log.info("trtllm: no engine for %s under %s/ (`make engine GPU=<gpu>` builds "
                     "one): serving the checkpoint through the LLM API", gpu.describe(),
                     default_engines_dir())
        return LlmApiBackend.load_checkpoint(model, gpu=gpu, max_seq_len=max_seq_len,
                                             warmup=warmup)
    return TrtllmBackend.load_engine(engine_dir, model, gpu, warmup=warmup)
