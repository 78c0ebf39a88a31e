"""One chat request on its way through the engine, for the routes that speak another API on top
of Chat Completions (:mod:`qwen_trt.api.responses`, :mod:`qwen_trt.api.messages`).

Such a route translates its request into a :class:`~qwen_trt.api.protocol.ChatRequest`, has the
chat path check, encode and submit it (``ApiContext.start_chat`` -> :class:`ChatRun`), then reads
:func:`chat_events`: the same stream deltas the chat endpoint sends (``{"content": ...}``, a
tool call's ``{"tool_calls": [{"index", "id", "function": {"name"}}]}`` then its argument
deltas), and one :class:`Done` at the end. Generation, stop strings, tool-call parsing and
queue places are the chat path's; only the wire format differs.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from qwen_trt.api.choices import ChatChoice, Piece
from qwen_trt.api.errors import ApiError
from qwen_trt.api.keepalive import KEEPALIVE, KeepAlive


@dataclass
class ChatRun:
    """A chat request submitted: its engine handles (one per choice), the choices that turn the
    reply into deltas, the prompt's length and the time it went in."""

    req: object                     # the ChatRequest
    handles: list
    choices: list[ChatChoice]
    n_prompt: int
    t0: float
    trace: object | None = None     # hop timings (the chat endpoint's own)


@dataclass(frozen=True)
class Done:
    """The reply ended: ``result`` is the engine's (finish_reason, token counts, cached tokens,
    the stop string); ``reason`` is the chat finish reason (``tool_calls`` when it called)."""

    result: object
    reason: str


async def chat_events(ctx, run: ChatRun, request=None,
                      beat_s: float | None = None) -> AsyncIterator[list[dict] | Done | None]:
    """Choice 0's stream deltas as they come (a list per engine wake-up, maybe empty), then a
    :class:`Done`; ``None`` every ``beat_s`` while nothing arrives. ``request``: a whole-reply
    client, whose leaving ends the stream (no :class:`Done` then). Raises ``ctx.engine_error``.
    The caller releases ``run.handles`` (``ctx.release``) when it is done."""
    choice = run.choices[0]
    gen = ctx.generate(run.handles[0], run.req, run.n_prompt, run.t0, request, None, beat_s)
    async for item in gen:
        if item is None:
            yield None
        elif isinstance(item, Piece):
            yield choice.feed(item)
        else:
            tail = choice.finish()
            if tail:
                yield tail
            yield Done(item, choice.finish_reason(item.finish_reason))


async def collect(ctx, run: ChatRun, request, feed) -> Done | None:
    """A whole reply: ``feed(deltas)`` for each batch, then its :class:`Done` (None: the client
    went away). Gives back the run's queue places; an engine failure is an ``ApiError``."""
    done = None
    try:
        async for item in chat_events(ctx, run, request):
            if isinstance(item, Done):
                done = item
            elif item:
                feed(item)
    except ctx.engine_error as e:
        raise ApiError(e.status, str(e)) from e
    finally:
        ctx.release(run.handles)
    return done


async def relay(ctx, run: ChatRun, feed, finish, fail) -> AsyncIterator[str]:
    """A stream's body after its opening events: ``feed(deltas)`` -> the text of their events
    (maybe empty), ``finish(done)`` -> the closing events' text, ``fail(error)`` -> the text
    that reports an engine failure; a keep-alive comment while nothing is sent for
    ``ctx.keepalive_s``."""
    keep = KeepAlive(ctx.keepalive_s)
    try:
        async for item in chat_events(ctx, run, None, keep.beat_s):
            if item is None:
                if keep.due():
                    keep.sent()
                    yield KEEPALIVE
            elif isinstance(item, Done):
                yield finish(item)
                return
            else:
                text = feed(item)
                if text:
                    keep.sent()
                    yield text
    except ctx.engine_error as e:
        yield fail(e)


def sse(event: str, obj: dict) -> str:
    """One server-sent event with a name (the Responses and Messages streams name theirs)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)      # line breaks to str.splitlines() (see server._data)
    return f"event: {event}\ndata: {text}\n\n"


def json_object(text: str) -> dict:
    """A call's arguments as an object ({} when they are not one: a call cut off mid-way)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def sse_response(body, ctx, run: "ChatRun"):
    """The streaming answer of a chat-shaped route: ``body`` as server-sent events, ``run``'s
    places freed when it ends (or never ran: the client left first)."""
    from fastapi.responses import StreamingResponse
    from starlette.background import BackgroundTask

    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(release_async, ctx.release, run.handles))


async def release_async(release, handles) -> None:
    """``release(handles)`` on the event loop (a stream's background task, for a client gone
    before the body ran: a plain function there would run in a worker thread)."""
    release(handles)
