"""Fake ``tensorrt_llm`` 1.3.0 top level: PyTorch backend only, no ``BuildConfig`` / ``build``
(the top level of main after the TensorRT backend's removal exports ``LLM`` and
``SamplingParams``, not the builder). ``CALLS`` records what the code under test asked."""
CALLS: list[tuple[str, dict]] = []

__version__ = "1.3.0"

from tensorrt_llm.llmapi import LLM, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "CALLS", "__version__"]
