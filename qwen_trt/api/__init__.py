"""The OpenAI-compatible HTTP API (``qwen-trt serve``): ``/v1/chat/completions`` (SSE streaming
and whole replies, tools, constrained output, logprobs, n), ``/v1/completions``,
``/v1/models[/{id}]``, ``/tokenize``, ``/detokenize``, ``/openapi.json``, ``/health`` and
Prometheus ``/metrics``, in front of the engine service (:mod:`qwen_trt.serving`); OpenAI's
Responses API (``/v1/responses``) and Anthropic's Messages API (``/v1/messages``) on the same
chat path.

* :mod:`qwen_trt.api.protocol` — the request, checked once into a typed :class:`ChatRequest`,
  and the response/chunk shapes;
* :mod:`qwen_trt.api.prompt` — messages to prompt ids (the chat template, contents as text);
* :mod:`qwen_trt.api.stops` — stop strings over a stream of text deltas;
* :mod:`qwen_trt.api.tools` — tools / tool_choice checked, ``<tool_call>`` blocks parsed;
* :mod:`qwen_trt.api.constraints` — response_format and tool_choice as the engine's grammar;
* :mod:`qwen_trt.api.logprobs` — token logprobs rendered (chat and legacy shapes);
* :mod:`qwen_trt.api.choices` — one chat choice's message / stream deltas;
* :mod:`qwen_trt.api.completions` — ``/v1/completions``, ``/v1/models/{id}``, tokenize;
* :mod:`qwen_trt.api.chat_run` — a submitted chat request, as the routes on top of chat read it;
* :mod:`qwen_trt.api.responses` — ``/v1/responses`` (translated to and from chat);
* :mod:`qwen_trt.api.responses_store` — the kept responses (LRU, bounded by count and bytes);
* :mod:`qwen_trt.api.messages` — ``/v1/messages`` (translated to and from chat);
* :mod:`qwen_trt.api.schema` — the pydantic models ``/openapi.json`` describes;
* :mod:`qwen_trt.api.metrics` — the Prometheus registry of one server;
* :mod:`qwen_trt.api.server` — the ASGI app (FastAPI) and :func:`run_server`.
"""
