"""Fake ``tensorrt_llm.executor``: the result types of the LLM API (executor/result.py)."""
from fake_trtllm.llmapi_impl import CompletionOutput, RequestOutput as GenerationResult  # noqa: F401
