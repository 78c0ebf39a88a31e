"""Slow clients: a request's headers must arrive within ``header_timeout_s`` (from the
connection, or from the first byte of a later request on it) and its body within
``body_timeout_s`` after them; otherwise the client gets a 408 in OpenAI's shape and the
connection closes. uvicorn has no such limits, so this is its HTTP/1.1 protocol (h11) with a
timer per connection, switched by the parser's state: headers (IDLE with bytes, or a new
connection), body (SEND_BODY), none otherwise (the response is being made; idle keep-alive
connections are uvicorn's ``timeout_keep_alive``).
"""
from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from qwen_trt.api.limits import error_response_bytes

log = logging.getLogger("qwen_trt.api")
RECHECK_S = 1.0     # a body still arriving while the response is already going out


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines (class attributes, see
    :func:`timed_protocol`)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def connection_made(self, transport) -> None:   # type: ignore[override]
        self._phase: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._set_phase("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    # -- the timer ---------------------------------------------------------------------------
    def _watch(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return self._set_phase(None)
        state = self.conn.their_state
        if state is h11.IDLE:
            # between requests: only bytes of a next request start its header clock
            pending = self.conn.trailing_data[0]
            self._set_phase("headers" if pending or self._phase == "headers" else None)
        elif state is h11.SEND_BODY:
            self._set_phase("body")
        else:
            self._set_phase(None)

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = phase
        if phase is not None:
            limit = self.header_timeout_s if phase == "headers" else self.body_timeout_s
            self._timer = self.loop.call_later(limit, self._expired, phase)

    def _expired(self, phase: str) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing():
            return
        cycle = self.cycle
        if phase == "body" and cycle is not None and not cycle.response_complete:
            if cycle.response_started:       # answered without reading it all: let it finish
                self._timer = self.loop.call_later(RECHECK_S, self._expired, phase)
                return
            cycle.disconnected = True        # the app's receive() now says the client left
            cycle.message_event.set()
        what = ("headers", self.header_timeout_s) if phase == "headers" else \
            ("body", self.body_timeout_s)
        log.info("closing a connection from %s: its request %s took over %g s", self.client,
                 what[0], what[1])
        self.transport.write(error_response_bytes(
            408, "Request Timeout", f"The request {what[0]} did not arrive within {what[1]:g} s.",
            "request_timeout"))
        self.transport.close()
        self._phase = None


def timed_protocol(header_timeout_s: float, body_timeout_s: float) -> type[TimedH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these deadlines."""
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})
