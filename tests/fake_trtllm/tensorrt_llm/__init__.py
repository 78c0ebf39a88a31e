"""Fake ``tensorrt_llm`` 1.2.1 top level.

Mirrors the 1.x exports of NVIDIA/TensorRT-LLM tensorrt_llm/__init__.py: ``BuildConfig``,
``build``, ``Mapping``, and the PyTorch-backend ``LLM`` and ``SamplingParams`` (plus
``__version__``). ``CALLS`` records every call the code under test
makes, for assertions.
"""
CALLS: list[tuple[str, dict]] = []

__version__ = "1.2.1"

from tensorrt_llm.builder import BuildConfig, build  # noqa: E402
from tensorrt_llm.llmapi import LLM, SamplingParams  # noqa: E402
from tensorrt_llm.mapping import Mapping  # noqa: E402

__all__ = ["BuildConfig", "build", "Mapping", "LLM", "SamplingParams", "CALLS", "__version__"]
