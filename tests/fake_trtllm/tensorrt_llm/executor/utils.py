"""Fake ``tensorrt_llm.executor.utils``: ``RequestError``, what the LLM API raises from a
request's result when the executor reported an error for it."""
from fake_trtllm.llmapi_impl import RequestError  # noqa: F401
