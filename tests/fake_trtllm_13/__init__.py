"""A second fake ``tensorrt_llm``: a release after 1.3.0rc20, with the PyTorch backend only.

The v1.3.0rc20 release notes announced it as the last release with the TensorRT backend, and the
docs page "Migration Guide: TensorRT Backend Removed" (PR #15767) says ``trtllm-build``, the
per-model ``convert_checkpoint.py`` and the engine builder are gone: ``LLM(model=<hf_model>)`` and
``trtllm-serve <hf_model>`` load Hugging Face checkpoints directly. So this install has the LLM
API (``LLM``, ``SamplingParams``, ``tensorrt_llm.llmapi.KvCacheConfig``; shared with the 1.2.1
fake, tests/fake_trtllm/llmapi_impl.py) and no ``builder``, ``runtime`` (ModelRunnerCpp) or
``models`` modules. Chosen per test with the ``fake_trtllm_13`` fixture (tests/fake_trtllm/
support.py)."""
