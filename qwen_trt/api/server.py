"""The ASGI app of ``qwen-trt serve``: OpenAI Chat Completions in front of the engine service.

It needs only the service surface (``submit(prompt_ids, params)`` -> a handle whose ``events()``
yields Waiting / Started / Delta / Finished / Failed, ``cancel()``, ``info``, ``tokenizer``,
``status()``), so the in-process service and the worker-process client serve it alike.

A handle's events reach the event loop without a thread per request
(:mod:`qwen_trt.serving.async_events`: the engine thread posts each step's events for all
requests with one loop wake-up), and each request sends one SSE chunk per wake-up with all its
new text. When a client goes away mid-reply, Starlette cancels the response task; that ends the
event reader, which cancels the handle, so the engine drops the request before its next token.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from qwen_trt.api.errors import ApiError, error_body
from qwen_trt.api.metrics import CONTENT_TYPE, ServerMetrics
from qwen_trt.api.encoder import PromptEncoder
from qwen_trt.api.hops import HopClock, RequestTrace
from qwen_trt.api.protocol import ChatRequest, ChunkWriter, completion, parse_chat_request
from qwen_trt.api.stops import StopScanner
from qwen_trt.errors import ConfigError, QwenTrtError
from qwen_trt.serving.async_events import Inbox, handle_batches, merge_deltas
from qwen_trt.serving.events import Delta, Failed, Finished, Started, Waiting

log = logging.getLogger("qwen_trt.api")

LOOPBACK_NAMES = ("localhost",)
DISCONNECT_CHECK_S = 0.2
DEAD_STATES = {"dead", "failed", "restarting", "starting", "loading", "closed", "stopped"}


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerSettings:
    """How ``qwen-trt serve`` listens; checked here, once."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 256                # requests waiting for the engine before 503
    model_name: str | None = None       # the id clients send as "model" (default: the model's)
    retry_after_s: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}.")
        if self.max_queue < 1:
            raise ConfigError(f"--max-queue must be >= 1, got {self.max_queue}.")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key / QWEN_TRT_API_KEY is empty: give a key or leave it unset.")
        if not is_loopback(self.host) and not self.api_key:
            raise ConfigError(f"Refusing to listen on {self.host} without a key: set --api-key or "
                              "QWEN_TRT_API_KEY (only 127.0.0.1 / localhost may go without one).")


def engine_alive(service) -> bool:
    """Whether the engine can take requests (False while it is dead or restarting)."""
    alive = getattr(service, "alive", None)
    if alive is not None:
        return bool(alive() if callable(alive) else alive)
    if getattr(service, "_closed", False):
        return False
    worker = getattr(service, "_worker", None)
    if worker is not None and hasattr(worker, "is_alive") and not worker.is_alive():
        return False
    try:
        st = service.status()
    except Exception:
        return False
    state = getattr(st, "state", None)
    return getattr(st, "alive", True) is not False and str(state).lower() not in DEAD_STATES


class _EngineError(Exception):
    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Result:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None    # when the engine reports prefix-cache hits per request


class _Counts:
    """Requests in flight, as the API sees them (touched from the event loop only)."""

    def __init__(self) -> None:
        self.waiting = 0
        self.running = 0


async def _events(handle, poll_s: float = 0.25,
                  trace: RequestTrace | None = None) -> AsyncIterator[object]:
    """The handle's events on the event loop, one Delta per wake-up (all text that arrived
    since the last one); ``None`` every ``poll_s`` while nothing arrives, as a heartbeat.
    Leaving early cancels the handle. ``trace`` gets each event's arrival on the loop."""
    if hasattr(handle, "listen"):
        inbox = Inbox()
        if trace is not None:
            inbox.stamps = trace.bridge
        async for items in handle_batches(handle, poll_s, inbox=inbox):
            if not items:
                yield None
            elif trace is not None:
                trace.arrived = time.perf_counter()
            for ev in merge_deltas(items):
                yield ev
        return
    async for ev in _thread_events(handle, poll_s):
        yield ev


async def _thread_events(handle, poll_s: float) -> AsyncIterator[object]:
    """A handle without :meth:`listen` (a service of another kind): one reader thread."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()

    def put(ev) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, ev)
        except RuntimeError:   # the loop is gone (server shutting down)
            pass

    def pump() -> None:
        try:
            for ev in handle.events(poll_s=poll_s):
                put(ev)
        except Exception as e:  # noqa: BLE001 - reported to the client as one line
            log.exception("reading request events failed")
            put(Failed(QwenTrtError(f"The engine connection failed ({type(e).__name__}: {e})")))

    threading.Thread(target=pump, name="api-events", daemon=True).start()
    try:
        while True:
            ev = await q.get()
            yield ev
            if isinstance(ev, (Finished, Failed)):
                return
    finally:
        if not getattr(handle, "done", False):
            handle.cancel()


def create_app(service, settings: ServerSettings = ServerSettings(), *,
               model_name: str | None = None, hops: HopClock | None = None) -> FastAPI:
    """The app for ``service``; ``model_name`` is the id served (default: the backend's model);
    ``hops`` collects per-request hop timings (default: on when ``QWEN_TRT_TRACE_HOPS=1``)."""
    info = service.info
    name = settings.model_name or model_name or info.model
    created = int(time.time())
    counts = _Counts()
    metrics = ServerMetrics(service.status, lambda: counts.waiting, lambda: counts.running)
    encoder = PromptEncoder(service.tokenizer)
    hops = hops if hops is not None else HopClock.from_env()
    app = FastAPI(title="qwen-trt", version="1", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service = service
    app.state.metrics = metrics
    app.state.counts = counts
    app.state.hops = hops

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), e.status_code), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _crash(_req: Request, e: Exception):
        log.exception("request failed")
        return JSONResponse(error_body(f"Internal error ({type(e).__name__}); see the server log.",
                                       500), status_code=500)

    def check_auth(request: Request) -> None:
        if not settings.api_key:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/health")
    async def health():
        if not engine_alive(service):
            return JSONResponse(error_body("The engine is not running (dead or restarting).", 503),
                                status_code=503)
        return Response(status_code=200)

    if hops is not None:
        @app.get("/debug/hops")
        async def hop_summary():
            st = service.status()
            return {**hops.summary(), "runner": getattr(st, "runner", None) or {}}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "qwen-trt",
            "root": info.model, "parent": None, "max_model_len": info.max_seq_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        t_in = time.perf_counter()
        raw = await request.body()
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"The body is not valid JSON ({e}).", code="invalid_json") from e
        req = parse_chat_request(obj)
        if req.model is not None and req.model != name:
            raise ApiError(404, f"The model '{req.model}' does not exist here; this server serves "
                                f"'{name}' (see /v1/models).", param="model",
                           code="model_not_found")
        # No liveness gate here: a service whose engine process died restarts it on the next
        # submit (the request waits meanwhile); a closed service refuses the submit (503).
        tokenizer = service.tokenizer
        if tokenizer is not encoder.tokenizer:      # the engine restarted with another one
            encoder.reset(tokenizer)
        t_parsed = time.perf_counter()
        ids = (encoder.encode(req.messages) if encoder.quick(req.messages)
               else await run_in_threadpool(encoder.encode, req.messages))
        t_encoded = time.perf_counter()
        max_new = _fit(ids, req, info)
        if counts.waiting >= settings.max_queue:
            metrics.requests.labels("queue_full").inc()
            raise ApiError(503, f"The server is busy: {counts.waiting} requests are already "
                                f"waiting (--max-queue {settings.max_queue}); retry shortly.",
                           code="queue_full",
                           headers={"Retry-After": str(settings.retry_after_s)})
        try:
            params = req.sampling_params(max_new)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        try:
            handle = service.submit(ids, params)
        except QwenTrtError as e:
            raise ApiError(503, str(e), headers={"Retry-After": str(settings.retry_after_s)}) from e
        metrics.prompt_tokens.inc(len(ids))
        t0 = time.perf_counter()
        trace = (RequestTrace(t_in, t_parsed, t_encoded, t0, len(ids)) if hops is not None
                 else None)
        if req.stream:
            return StreamingResponse(_sse(handle, req, len(ids), t0, trace),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        parts: list[str] = []
        result = None
        try:
            async for item in _generate(handle, req, len(ids), t0, request, trace):
                if isinstance(item, str):
                    parts.append(item)
                else:
                    result = item
        except _EngineError as e:
            raise ApiError(e.status, str(e)) from e
        if result is None:     # the client went away
            return Response(status_code=499)
        return completion(name, "".join(parts), result.finish_reason, result.prompt_tokens,
                          result.completion_tokens, result.cached_tokens)

    async def _generate(handle, req: ChatRequest, n_prompt: int, t0: float,
                        request: Request | None = None,
                        trace: RequestTrace | None = None) -> AsyncIterator[str | _Result]:
        """Text to send, then one :class:`_Result`; raises :class:`_EngineError`."""
        scanner = StopScanner(req.stop)
        counts.waiting += 1
        state = "waiting"
        first = True
        outcome = "cancelled"
        checked = time.monotonic()
        try:
            async for ev in _events(handle, trace=trace):
                # A whole-reply client that leaves is noticed within DISCONNECT_CHECK_S (a
                # streaming one at once: Starlette cancels its response task).
                if request is not None and time.monotonic() - checked >= DISCONNECT_CHECK_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if ev is None or isinstance(ev, Waiting):
                    pass
                elif isinstance(ev, Started):
                    if state == "waiting":
                        counts.waiting -= 1
                        counts.running += 1
                        state = "running"
                elif isinstance(ev, Delta):
                    text = scanner.feed(ev.text)
                    if scanner.stopped:
                        handle.cancel()      # stop string: the engine stops before its next token
                    if text:
                        if first:
                            metrics.ttft.observe(time.perf_counter() - t0)
                            first = False
                        yield text
                elif isinstance(ev, Finished):
                    m = ev.reply.metrics
                    reason = m.finish_reason
                    if scanner.stopped:
                        reason = "stop"
                    elif reason == "cancelled":
                        outcome = "error"
                        raise _EngineError("The request was cancelled by the server "
                                           "(shutting down or restarting); retry.", 503)
                    else:
                        tail = scanner.flush()
                        if tail:
                            if first:
                                metrics.ttft.observe(time.perf_counter() - t0)
                            yield tail
                    if not scanner.stopped and reason in ("stop", "length"):
                        encoder.remember(ev.reply.text, ev.reply.token_ids)
                    metrics.generation_tokens.inc(m.tokens)
                    if m.decode_tok_s > 0:
                        metrics.tok_s.observe(m.decode_tok_s)
                    outcome = reason
                    yield _Result(reason, n_prompt, m.tokens, getattr(m, "cached_tokens", None))
                elif isinstance(ev, Failed):
                    outcome = "error"
                    raise _EngineError(str(ev.error))
        finally:
            if state == "waiting":
                counts.waiting -= 1
            elif state == "running":
                counts.running -= 1
            metrics.requests.labels(outcome).inc()
            if trace is not None:
                hops.add(trace)

    async def _sse(handle, req: ChatRequest, n_prompt: int, t0: float,
                   trace: RequestTrace | None = None) -> AsyncIterator[str]:
        w = ChunkWriter(name, include_usage=req.include_usage)
        yield _data(w.chunk({"role": "assistant", "content": ""}))
        try:
            async for item in _generate(handle, req, n_prompt, t0, trace=trace):
                if isinstance(item, str):
                    frame = _data(w.chunk({"content": item}))
                    if trace is not None:
                        trace.framed(time.perf_counter())
                    yield frame
                else:
                    yield _data(w.chunk({}, item.finish_reason))
                    if req.include_usage:
                        yield _data(w.usage_chunk(item.prompt_tokens, item.completion_tokens,
                                                  item.cached_tokens))
        except _EngineError as e:
            yield _data(error_body(str(e), e.status))
        yield "data: [DONE]\n\n"

    return app


# Characters Python's str.splitlines() breaks on that JSON leaves unescaped with
# ensure_ascii=False: a client reading the stream with splitlines (httpx's aiter_lines) would cut
# the event in two. Escaped, the decoded text is the same.
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_LINE_BREAK_RE = re.compile("[\x85\u2028\u2029]")


def _data(obj: dict) -> str:
    text = json.dumps(obj, ensure_ascii=False, separators=(',', ':'))
    if _LINE_BREAK_RE.search(text):
        text = _LINE_BREAK_RE.sub(lambda m: _LINE_BREAKS[m.group()], text)
    return f"data: {text}\n\n"


def _fit(ids: list[int], req: ChatRequest, info) -> int:
    """The number of new tokens to ask for; 400 (with the counts) when it cannot fit."""
    n, ctx = len(ids), info.max_seq_len
    if n > info.max_input_len or n >= ctx:
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens (prompts up to "
                            f"{info.max_input_len}). However, your messages resulted in {n} "
                            "tokens. Please shorten the messages.", param="messages",
                       code="context_length_exceeded")
    if req.max_tokens is None:
        return ctx - n
    if n + req.max_tokens > ctx:
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, you "
                            f"requested {n + req.max_tokens} tokens ({n} in the messages, "
                            f"{req.max_tokens} in the completion). Please reduce the length of "
                            "the messages or the completion.", param="max_tokens",
                       code="context_length_exceeded")
    return req.max_tokens


def run_server(service, settings: ServerSettings, *, model_name: str | None = None,
               log_level: str = "info") -> None:
    """Serve until interrupted, then free the engine."""
    import uvicorn

    app = create_app(service, settings, model_name=model_name)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            timeout_graceful_shutdown=5, access_log=False)
    server = uvicorn.Server(config)
    try:
        server.run()
    finally:
        service.close()
