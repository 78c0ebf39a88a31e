"""Fake ``tensorrt_llm.sampling_params`` (tensorrt_llm/sampling_params.py @000a01de)."""
from fake_trtllm.llmapi_impl import GuidedDecodingParams, SamplingParams  # noqa: F401
