"""What an operator sees of each request: its request id, its access-log line, its error count.

:class:`RequestLog` is a plain ASGI middleware, outside every other one of the app:

- **Request id.** ``x-request-id`` from the client when it is a short, printable token (what
  proxies and the SDKs send: up to 128 of ``A-Za-z0-9._:-``), else a fresh ``req_<hex>``; it is
  sent back on every response (so the openai SDK's ``_request_id`` is set) and kept in the
  request's scope (``scope[REQUEST_ID]``: the 500 handler, which runs outside, adds it too).
- **Access log.** One line per request on the ``qwen_trt.access`` logger when the response
  ends (a stream: when its last chunk has left): client, method, path, status, milliseconds,
  request id. The path is the request's path without the query, control characters escaped and
  cut at 200 characters (it is the client's text). A client that left before the response
  started is logged as status 499. ``--no-access-log`` turns the line off.
- **Errors by endpoint.** Every 4xx / 5xx response counts in ``qwen_trt_http_errors_total``
  by ``endpoint`` (the route's path template, e.g. ``/v1/models/{model_id}``; ``other`` for a
  path no route knows, so scanners cannot grow the label set) and ``status``.
"""
from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
import uuid

from starlette.routing import Match

log = logging.getLogger("qwen_trt.access")
REQUEST_ID = "qwen_trt.request_id"        # the scope key holding the request's id
HEADER = b"x-request-id"
_GOOD_ID = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\\\"]")
MAX_PATH = 200


def request_id(scope) -> str | None:
    """The id :class:`RequestLog` gave this request (None outside it)."""
    return scope.get(REQUEST_ID)


def id_headers(scope) -> dict[str, str]:
    rid = request_id(scope)
    return {"x-request-id": rid} if rid else {}


def _incoming_id(scope) -> str:
    for name, value in scope.get("headers") or ():
        if name == HEADER:
            if _GOOD_ID.match(value):
                return value.decode("ascii")
            break
    return f"req_{uuid.uuid4().hex}"


def _printable(path: str) -> str:
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", path)
    return text if len(text) <= MAX_PATH else text[:MAX_PATH] + "..."


def endpoint(scope) -> str:
    """The path template of the route that takes this request, or ``other``."""
    app = scope.get("app")
    for route in getattr(getattr(app, "router", None), "routes", ()):
        try:
            match, _ = route.matches(scope)
        except Exception:  # noqa: BLE001 - a route that cannot say: not this one
            continue
        if match is not Match.NONE:
            return getattr(route, "path", "other")
    return "other"


class RequestLog:
    """The ASGI middleware (module docstring). ``errors``: a prometheus Counter labelled
    ``endpoint, status``; ``enabled``: whether the access-log line is written."""

    def __init__(self, app, *, errors=None, enabled: bool = True) -> None:
        self.app = app
        self.errors = errors
        self.enabled = enabled

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _incoming_id(scope)
        scope[REQUEST_ID] = rid
        t0 = time.perf_counter()
        status = 499
        raw_id = rid.encode("ascii")

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                headers.append((HEADER, raw_id))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException as e:
            if status == 499 and not isinstance(e, (OSError, asyncio.CancelledError)):
                status = 500       # the app's 500 handler answers (outside this middleware)
            raise
        finally:
            self._done(scope, status, time.perf_counter() - t0, rid)

    def _done(self, scope, status: int, seconds: float, rid: str) -> None:
        if self.errors is not None and status >= 400:
            self.errors.labels(endpoint(scope), str(status)).inc()
        if self.enabled:
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            log.info('%s "%s %s" %d %.1fms request_id=%s', who, scope.get("method", "-"),
                     _printable(scope.get("path", "")), status, seconds * 1e3, rid)


def log_to_stderr() -> None:
    """The access-log lines on stderr (``qwen-trt serve``), whatever ``--log-level`` says:
    they are what ``--no-access-log`` turns off."""
    if any(getattr(h, "_qwen_trt_access", False) for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s access %(message)s"))
    handler._qwen_trt_access = True
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
