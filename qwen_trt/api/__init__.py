"""The OpenAI-compatible HTTP API (``qwen-trt serve``): ``/v1/chat/completions`` (SSE streaming
and whole replies), ``/v1/models``, ``/health`` and Prometheus ``/metrics``, in front of the
engine service (:mod:`qwen_trt.serving`).

* :mod:`qwen_trt.api.protocol` — the request, checked once into a typed :class:`ChatRequest`,
  and the response/chunk shapes;
* :mod:`qwen_trt.api.prompt` — messages to prompt ids (the chat template, contents as text);
* :mod:`qwen_trt.api.stops` — stop strings over a stream of text deltas;
* :mod:`qwen_trt.api.metrics` — the Prometheus registry of one server;
* :mod:`qwen_trt.api.server` — the ASGI app (FastAPI) and :func:`run_server`.
"""
