"""Fake ``tensorrt_llm.llmapi``: ``LLM``, ``SamplingParams``, ``KvCacheConfig``, ``RequestOutput``
(the implementation, shared by both fake installs, is tests/fake_trtllm/llmapi_impl.py)."""
from fake_trtllm.llmapi_impl import (LLM, CompletionOutput, GuidedDecodingParams,  # noqa: F401
                                     KvCacheConfig, RequestOutput, SamplingParams)
