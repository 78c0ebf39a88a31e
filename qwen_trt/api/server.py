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
import json
import logging
import re
import threading
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from qwen_trt.api import constraints
from qwen_trt.api.access import RequestLog, id_headers
from qwen_trt.api.admission import Admission, Ticket
from qwen_trt.api.choices import ChatChoice, Piece, merge
from qwen_trt.api.chat_run import ChatRun
from qwen_trt.api.completions import ApiContext, add_routes, model_card
from qwen_trt.api.messages import add_messages_routes
from qwen_trt.api.responses import add_responses_routes, responses_store
from qwen_trt.api.errors import ApiError, error_body, excerpt
from qwen_trt.api.guards import HostCheck, RequestGuard
from qwen_trt.api.keepalive import KEEPALIVE, KeepAlive
from qwen_trt.api.limits import (MIB, BodyLimit, chars_per_token, context_too_long, decode_json,
                                 min_prompt_tokens)
from qwen_trt.api.logprobs import token_texts
from qwen_trt.api.metrics import CONTENT_TYPE, ServerMetrics
from qwen_trt.api.encoder import QUICK_CHARS, PromptEncoder
from qwen_trt.api.health import health_of
from qwen_trt.api.hops import HopClock, RequestTrace
from qwen_trt.api.prompt import PromptTooLong, encode_messages, text_ids, text_ids_ready
from qwen_trt.api.protocol import (ChatRequest, ChunkWriter, new_id, parse_chat_request,
                                   prediction_counts, usage)
from qwen_trt.api.schema import describe_openapi
from qwen_trt.api.stops import StopScanner
from qwen_trt.errors import QwenTrtError
from qwen_trt.params import fit_problem
from qwen_trt.serving.async_events import Inbox, handle_batches, merge_deltas
from qwen_trt.serving.events import Delta, Failed, Finished, Started, Waiting, WorkerStoppedError
from qwen_trt.serving.session import PromptTokensError

from qwen_trt.api.server_settings import ServerSettings

log = logging.getLogger("qwen_trt.api")

DISCONNECT_CHECK_S = 0.2
TOKENIZE_AT_ONCE = 2      # prompts tokenised at the same time (each may hold a large encoding)


def engine_alive(service) -> bool:
    """Whether the engine can take requests (False while it loads, restarts, is dead or closed)."""
    try:
        return service.status().accepting
    except Exception:  # noqa: BLE001 - a service that cannot even report is not alive
        return False


class _RequestError(Exception):
    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Result:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None    # when the engine reports prefix-cache hits per request
    stop: str | None = None             # the stop string that ended the reply
    prediction: tuple[int, int] | None = None   # (accepted, rejected) prediction tokens


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
    metrics = ServerMetrics(service.status, lambda: counts.waiting, lambda: counts.running,
                            lambda: service.info, model_name=name)
    admission = Admission(counts, settings.max_queue, settings.retry_after_s)
    # Tokenising runs in worker threads with the GIL released (see serving.session._Codec), a few at
    # a time; /health and other requests go on meanwhile.
    tokenizing = asyncio.Semaphore(TOKENIZE_AT_ONCE)
    # chars_per_token(tokenizer): worked out now (it reads the whole vocabulary), so nothing of
    # it is left for the first request once /health says ready (api.startup builds this app
    # before it answers 200)
    per_token: list = [chars_per_token(service.tokenizer)]
    tok_lock = threading.Lock()   # /tokenize and /detokenize call the HF tokenizer itself
    tickets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # handle -> its Ticket
    encoder = PromptEncoder(service.tokenizer)
    attach_loop = getattr(service, "attach_loop", None)
    hops = hops if hops is not None else HopClock.from_env()
    app = FastAPI(title="qwen-trt", version="1", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.add_middleware(BodyLimit, max_bytes=int(settings.max_body_mb * MIB))
    app.add_middleware(RequestGuard, hosts=HostCheck(settings.host, settings.allowed_hosts))
    if settings.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])
    # outermost: the request id and the access line cover every answer, 413s and CORS too
    app.add_middleware(RequestLog, errors=metrics.http_errors, enabled=settings.access_log)
    app.state.service = service
    app.state.metrics = metrics
    app.state.counts = counts
    app.state.admission = admission
    app.state.hops = hops

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), e.status_code), status_code=e.status_code,
                            headers=e.headers)      # a 405's Allow

    @app.exception_handler(ClientDisconnect)
    async def _gone(_req: Request, _e: ClientDisconnect):
        return Response(status_code=499)     # nobody reads it: the client left mid-body

    @app.exception_handler(Exception)
    async def _crash(_req: Request, e: Exception):
        log.exception("request failed")
        return JSONResponse(error_body(f"Internal error ({type(e).__name__}); see the server log.",
                                       500), status_code=500, headers=id_headers(_req.scope))

    def check_auth(request: Request) -> None:
        if not settings.api_key:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer":        # Anthropic's clients send x-api-key
            token = request.headers.get("x-api-key", "") if not got else ""
        if not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/health")
    async def health():
        code, body = health_of(service)
        return JSONResponse(body, status_code=code)

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
        return {"object": "list", "data": [model_card(name, created, info)]}

    async def start_chat(req: ChatRequest, t_in: float) -> ChatRun:
        """``req`` checked against this server and its engine, encoded and submitted (400 /
        404 / 503 as :class:`ApiError`): what every chat-shaped route streams or collects."""
        if req.model is not None and req.model != name:
            raise ApiError(404, f"The model {excerpt(req.model)} does not exist here; this "
                                f"server serves '{name}' (see /v1/models).", param="model",
                           code="model_not_found")
        await constraints.check(req.grammar, req.grammar_param, service.tokenizer,  # off the loop
                                req.max_tokens)
        constraints.check_backend(info, req.grammar, req.grammar_param, req.logprobs)
        _check_logit_bias(req, info, service.tokenizer)
        admission.check_fits(req.n, f"n = {req.n}")
        _queue_check()
        # No liveness gate here: a service whose engine process died restarts it on the next
        # submit (the request waits meanwhile); a closed service refuses the submit (503).
        tokenizer = service.tokenizer
        tools = req.tools.tools if req.tools.render else None
        room = _room(req, info)
        at_least = min_prompt_tokens(req.messages, await bound())
        if at_least > room:        # cannot fit, whatever the tokenizer makes of it
            raise _too_long(at_least, req, info, bound=True)

        if tokenizer is not encoder.tokenizer:      # the engine restarted with another one
            encoder.reset(tokenizer)
        t_parsed = time.perf_counter()

        def encode():
            try:
                return encoder.encode(req.messages, tools, limit=room)
            except PromptTokensError as e:
                raise _too_long(e.tokens, req, info) from None

        if encoder.quick(req.messages):      # short: on the loop, no thread hop
            ids = encode()
        else:
            async with tokenizing:
                ids = await run_in_threadpool(encode)
        t_encoded = time.perf_counter()
        max_new = _fit(ids, req, info)
        pred = ()
        if req.prediction:          # its tokens draft for the speculative path
            try:
                pred = tuple(await tokenize(req.prediction, False, limit=info.max_seq_len))
            except PromptTooLong as e:
                raise ApiError(400, f"'prediction' has at least {e.tokens} tokens, more than the "
                                    f"model's context ({info.max_seq_len}).", param="prediction",
                               code="context_length_exceeded") from None
        handles = await submit(ids, req.choice_params(max_new, pred))
        texts = token_texts(tokenizer) if req.logprobs is not None else None
        choices = [ChatChoice(i, req.tools, texts, req.logprobs) for i in range(req.n)]
        t0 = time.perf_counter()
        trace = (RequestTrace(t_in, t_parsed, t_encoded, t0, len(ids))
                 if hops is not None and req.n == 1 else None)
        return ChatRun(req, handles, choices, len(ids), t0, trace)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        t_in = time.perf_counter()
        raw = await request.body()
        req = parse_chat_request(decode_json(raw))
        run = await start_chat(req, t_in)
        handles, choices, n_prompt, t0, trace = (run.handles, run.choices, run.n_prompt, run.t0,
                                                 run.trace)
        if req.stream:
            # the background task frees the places when the body never ran (client gone first)
            return StreamingResponse(_sse(handles, choices, req, n_prompt, t0, trace),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(release_async, handles))
        results: list = [None] * req.n
        try:
            async for i, item in merge([_generate(h, req, n_prompt, t0, request, trace)
                                        for h in handles]):
                if isinstance(item, Piece):
                    choices[i].feed(item)
                else:
                    choices[i].finish()
                    results[i] = item
        except _RequestError as e:
            raise ApiError(e.status, str(e)) from e
        finally:
            release(handles)
        if any(r is None for r in results):     # the client went away
            return Response(status_code=499)
        return {"id": new_id(), "object": "chat.completion", "created": int(time.time()),
                "model": name,
                "choices": [c.choice(r.finish_reason) for c, r in zip(choices, results)],
                "usage": _usage(results)}

    async def submit(ids: list[int], params_list) -> list:
        """Hand ``ids`` to the engine once per choice, each with its place in the queue (503
        when the queue is full or the server is closing)."""
        handles: list = []
        if attach_loop is not None:        # the engine client reads its pipe on this loop
            attach_loop(asyncio.get_running_loop())
        try:
            for params in params_list:
                ticket = _take()          # the queue check and this place, at once
                try:
                    ticket.handle = service.submit(ids, params)
                except BaseException:
                    ticket.release()
                    raise
                tickets[ticket.handle] = ticket
                handles.append(ticket.handle)
        except QwenTrtError as e:
            release(handles)
            raise ApiError(503, str(e), headers={"Retry-After": str(settings.retry_after_s)}) from e
        except BaseException:
            release(handles)
            raise
        metrics.prompt_tokens.inc(len(ids))
        return handles

    def release(handles) -> None:
        """Give back the places of ``handles`` (each once; cancels those still running)."""
        for h in handles:
            ticket = tickets.get(h)
            if ticket is not None:
                ticket.release()

    async def release_async(handles) -> None:
        """:func:`release` on the event loop (a response's background task: a plain function
        there would be run in a worker thread)."""
        release(handles)

    async def bound() -> int | None:
        """chars_per_token of the tokenizer (worked out once, in a worker thread)."""
        if not per_token:
            per_token.append(await run_in_threadpool(chars_per_token, service.tokenizer))
        return per_token[0]

    async def encode_chat(messages, tools, add_generation_prompt: bool = True,
                          limit: int | None = None) -> list[int]:
        """The template's ids (PromptTooLong past ``limit``: from the bound, or counted)."""
        if limit is not None:
            at_least = min_prompt_tokens(messages, await bound())
            if at_least > limit:
                raise PromptTooLong(at_least, limit, at_least=True)

        def run():
            try:
                return encode_messages(service.tokenizer, messages, tools=tools,
                                       add_generation_prompt=add_generation_prompt, limit=limit)
            except PromptTokensError as e:
                raise PromptTooLong(e.tokens, e.limit) from None
        async with tokenizing:
            return await run_in_threadpool(run)

    async def min_tokens(text: str) -> int:
        """Tokens ``text`` has at least, from the character bound (0 without one)."""
        return min_prompt_tokens(({"content": text},), await bound())

    async def tokenize(text: str, add_special_tokens: bool, limit: int | None = None,
                       ) -> list[int]:
        """``text`` as the tokenizer encodes it (control tokens parsed); PromptTooLong past
        ``limit`` (from the bound, else counted). Short texts on the loop, long ones in a worker
        thread with the GIL released."""
        if limit is not None:
            at_least = await min_tokens(text)
            if at_least > limit:
                raise PromptTooLong(at_least, limit, at_least=True)

        def run():
            return text_ids(service.tokenizer, text, add_special_tokens=add_special_tokens,
                            limit=limit, lock=tok_lock)
        if len(text) <= QUICK_CHARS and text_ids_ready(service.tokenizer):
            return run()
        async with tokenizing:
            return await run_in_threadpool(run)

    async def detokenize(ids: list[int]) -> str:
        def run():
            with tok_lock:
                return service.tokenizer.decode(ids)
        async with tokenizing:
            return await run_in_threadpool(run)

    def _queue_check() -> None:
        try:
            admission.check()
        except ApiError as e:
            metrics.requests.labels(e.code or "refused").inc()
            raise

    def _take() -> Ticket:
        try:
            return admission.take()
        except ApiError as e:
            metrics.requests.labels(e.code or "refused").inc()
            raise

    async def _generate(handle, req, n_prompt: int, t0: float, request: Request | None = None,
                        trace: RequestTrace | None = None, beat_s: float | None = None,
                        ) -> AsyncIterator[Piece | _Result | None]:
        """Text to send (with its tokens' logprobs), then one :class:`_Result`; raises
        :class:`_RequestError`. ``req``: anything with ``stop`` (chat or completions).
        ``handle`` came from :func:`submit`, which holds its place in the queue. With
        ``beat_s``, also ``None`` every ``beat_s`` seconds while nothing arrives (the caller's
        keep-alive clock)."""
        scanner = StopScanner(req.stop)
        ticket = tickets.get(handle)
        lps: list = []          # logprobs of tokens whose text the stop scanner holds back
        tokens = 0
        first = True
        outcome = "cancelled"
        checked = time.monotonic()
        try:
            async for ev in _events(handle, beat_s or 0.25, trace=trace):
                # A whole-reply client that leaves is noticed within DISCONNECT_CHECK_S (a
                # streaming one at once: Starlette cancels its response task).
                if request is not None and time.monotonic() - checked >= DISCONNECT_CHECK_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if ev is None or isinstance(ev, Waiting):
                    if beat_s:
                        yield None
                elif isinstance(ev, Started):
                    if ticket is not None:
                        ticket.started()
                elif isinstance(ev, Delta):
                    stopped = scanner.stopped
                    text = scanner.feed(ev.text)
                    if not stopped:
                        lps.extend(ev.logprobs)
                        tokens += len(ev.token_ids) or 1
                    if scanner.stopped:
                        handle.cancel()      # stop string: the engine stops before its next token
                    if text:
                        if first:
                            metrics.ttft.observe(time.perf_counter() - t0)
                            first = False
                        yield Piece(text, tuple(lps), tokens)
                        lps, tokens = [], 0
                elif isinstance(ev, Finished):
                    m = ev.reply.metrics
                    reason = m.finish_reason
                    if scanner.stopped:
                        reason = "stop"
                    elif reason == "cancelled":
                        outcome = "error"
                        raise _RequestError("The request was cancelled by the server "
                                           "(shutting down or restarting); retry.", 503)
                    else:
                        tail = scanner.flush()
                        if tail or lps:
                            if first:
                                metrics.ttft.observe(time.perf_counter() - t0)
                            yield Piece(tail, tuple(lps), tokens)
                    if not scanner.stopped and reason in ("stop", "length"):
                        encoder.remember(ev.reply.text, ev.reply.token_ids)
                    metrics.generation_tokens.inc(m.tokens)
                    if m.decode_tok_s > 0:
                        metrics.tok_s.observe(m.decode_tok_s)
                    outcome = reason
                    pred = getattr(getattr(handle, "params", None), "prediction", ())
                    yield _Result(reason, n_prompt, m.tokens, getattr(m, "cached_tokens", None),
                                  scanner.matched,
                                  prediction_counts(list(pred), list(ev.reply.token_ids))
                                  if pred else None)
                elif isinstance(ev, Failed):
                    outcome = "error"       # the engine died under it: retryable (503)
                    raise _RequestError(str(ev.error), 503 if isinstance(
                        ev.error, WorkerStoppedError) else 500)
        finally:
            if ticket is not None:
                ticket.release()
            metrics.requests.labels(outcome).inc()
            if trace is not None:
                hops.add(trace)

    async def _sse(handles, choices: list[ChatChoice], req: ChatRequest, n_prompt: int,
                   t0: float, trace: RequestTrace | None = None) -> AsyncIterator[str]:
        w = ChunkWriter(name, include_usage=req.include_usage)
        running = [0] * len(choices)        # completion tokens so far, per choice
        keep = KeepAlive(settings.sse_keepalive_s)

        def chunk(c: ChatChoice, delta: dict, reason: str | None = None) -> str:
            live = (usage(n_prompt, sum(running)) if req.continuous_usage else None)
            return _data(w.chunk(delta, reason, index=c.index, logprobs=c.take_logprobs(),
                                 usage=live))

        # Events that are ready together leave in one write (one socket send, one loop pass):
        # the role chunks; a piece's deltas; a finished choice's last chunks wait for the
        # next write (the next piece, or the end: usage and [DONE]).
        yield "".join(_data(w.chunk({"role": "assistant", "content": ""}, index=c.index,
                                    logprobs=None, usage=usage(n_prompt, 0)
                                    if req.continuous_usage else None)) for c in choices)
        results: list = [None] * len(choices)
        held: list[str] = []
        try:
            async for i, item in merge([_generate(h, req, n_prompt, t0, None, trace,
                                                  keep.beat_s) for h in handles]):
                c = choices[i]
                if item is None:
                    if keep.due():
                        keep.sent()
                        yield "".join(held) + KEEPALIVE
                        held.clear()
                    continue
                keep.sent()
                if isinstance(item, Piece):
                    running[i] += item.tokens
                    held += [chunk(c, delta) for delta in c.feed(item)]
                    if held:
                        yield "".join(held)
                        held.clear()
                    if trace is not None:
                        trace.framed(time.perf_counter())
                else:
                    results[i] = item
                    running[i] = item.completion_tokens
                    held += [chunk(c, delta) for delta in c.finish()]
                    held.append(chunk(c, {}, c.finish_reason(item.finish_reason)))
            if req.include_usage:
                u = _usage(results)
                d = u.get("completion_tokens_details")
                held.append(_data(w.usage_chunk(u["prompt_tokens"], u["completion_tokens"],
                                                (u.get("prompt_tokens_details") or {}).get(
                                                    "cached_tokens"),
                                                (d["accepted_prediction_tokens"],
                                                 d["rejected_prediction_tokens"]) if d else None)))
        except _RequestError as e:
            held.append(_data(error_body(str(e), e.status)))
        yield "".join(held) + "data: [DONE]\n\n"

    ctx = ApiContext(name=name, created=created, service=service, check_auth=check_auth,
                     submit=submit, generate=_generate, encode_chat=encode_chat,
                     tokenize=tokenize, detokenize=detokenize, engine_error=_RequestError,
                     data=_data, release=release, start_chat=start_chat,
                     keepalive_s=settings.sse_keepalive_s,
                     check_fits=admission.check_fits, min_tokens=min_tokens)
    add_routes(app, ctx)
    add_responses_routes(app, ctx, responses_store(settings))
    add_messages_routes(app, ctx)
    describe_openapi(app)
    return app


def _check_logit_bias(req: ChatRequest, info, tokenizer) -> None:
    """400 for a ``logit_bias`` the backend cannot apply (ours do, on the device with the
    other logit processors: the same backends that take grammars) or naming a token id beyond
    the vocabulary."""
    if not req.logit_bias:
        return
    if not getattr(info, "grammar", False):
        raise ApiError(400, f"'logit_bias' is not applied by the {info.name} backend (the torch "
                            "backend applies it).", param="logit_bias",
                       code="unsupported_parameter")
    vocab = len(tokenizer) if tokenizer is not None else None
    bad = [t for t, _ in req.logit_bias if vocab is not None and t >= vocab]
    if bad:
        raise ApiError(400, f"'logit_bias' names token {bad[0]}, beyond the vocabulary of "
                            f"{vocab} tokens.", param="logit_bias")


def _usage(results) -> dict:
    """Usage of one request: the prompt once, the completions of every choice."""
    cached = [r.cached_tokens for r in results if r.cached_tokens is not None]
    preds = [r.prediction for r in results if r.prediction is not None]
    return usage(results[0].prompt_tokens, sum(r.completion_tokens for r in results),
                 cached[0] if cached else None,
                 (sum(p[0] for p in preds), sum(p[1] for p in preds)) if preds else None)
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


def _room(req: ChatRequest, info) -> int:
    """The most prompt tokens this request may have (see :func:`_fit`)."""
    ctx = info.max_seq_len
    room = min(info.max_input_len, ctx - 1)
    return room if req.max_tokens is None else min(room, ctx - req.max_tokens)


def _too_long(n: int, req: ChatRequest, info, bound: bool = False) -> ApiError:
    """The 400 for a prompt of ``n`` tokens (``bound``: at least ``n``) that does not fit."""
    ctx = info.max_seq_len
    alone = req.max_tokens is None or n > min(info.max_input_len, ctx - 1)
    return context_too_long(ctx, info.max_input_len, n, None if alone else req.max_tokens,
                            bound=bound)


def _fit(ids: list[int], req: ChatRequest, info) -> int:
    """The number of new tokens to ask for; 400 (with the counts) when it cannot fit."""
    n, ctx = len(ids), info.max_seq_len
    if fit_problem(n, 1, info.max_input_len, ctx):
        raise context_too_long(ctx, info.max_input_len, n)
    if req.max_tokens is None:
        return ctx - n
    if fit_problem(n, req.max_tokens, info.max_input_len, ctx):
        raise context_too_long(ctx, info.max_input_len, n, req.max_tokens)
    return req.max_tokens


def run_server(service, settings: ServerSettings, *, model_name: str | None = None,
               log_level: str = "info") -> None:
    """Serve until SIGTERM/SIGINT (see :mod:`qwen_trt.api.shutdown`), then free the engine.
    The port answers at once: ``/health`` says 503 "loading" until the engine is ready
    (:mod:`qwen_trt.api.startup`); a load error is raised once the server has stopped."""
    from qwen_trt.api.startup import serve_while_loading

    if settings.access_log:
        from qwen_trt.api.access import log_to_stderr

        log_to_stderr()
    try:
        serve_while_loading(service, lambda: create_app(service, settings, model_name=model_name),
                            settings, log_level=log_level)
    finally:
        service.close()
