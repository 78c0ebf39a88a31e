"""A request handle's events on an asyncio loop, without a thread per request.

The engine side emits events on its own thread (the worker client's reader thread, once per
engine step for all requests of that step), or on the loop itself when the loop reads the
engine pipe (``WorkerClient.attach_loop``: then no wake-up is needed at all, the drain is
merely scheduled). :class:`LoopSink` moves them onto the event loop:
each request gets an :class:`Inbox` (a list and a future, both touched on the loop only), and
the emitting thread hands every event of a burst to the loop with **one**
``loop.call_soon_threadsafe`` — inside :func:`batch` (the worker client wraps each step's
message in it) exactly one per step, whatever the number of requests.

:func:`handle_batches` is the consumer: it yields lists of events (everything that arrived
since the last wake-up: one step's Delta per request, or several when the loop fell behind),
and an empty list every ``poll_s`` while nothing arrives (a heartbeat, so a caller can check
for a client that went away). Leaving early cancels the handle.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator

from qwen_trt.serving.events import Delta, Failed, Finished

_local = threading.local()


@contextlib.contextmanager
def batch() -> Iterator[None]:
    """Events posted by this thread inside the block reach each loop in one wake-up, at exit."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    if depth == 0:
        _local.sinks = set()
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            sinks, _local.sinks = _local.sinks, set()
            for sink in sinks:
                sink._schedule()


class Inbox:
    """One request's events on the loop (loop-confined). :meth:`take`'s timeout needs no timer
    per call: one timer per wait period is armed, and moved on when it fires early (events
    arrived meanwhile), so a request that gets a token every step costs no timer per token."""

    __slots__ = ("items", "_waiter", "stamps", "_deadline", "_timer")

    def __init__(self) -> None:
        self.items: list = []
        self._waiter: asyncio.Future | None = None
        self.stamps: list[tuple[float, float]] | None = None   # (emitted, on the loop), if kept
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def _push(self, ev, emitted: float) -> None:
        self.items.append(ev)
        if self.stamps is not None:
            self.stamps.append((emitted, time.perf_counter()))
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self, timeout: float) -> list:
        """All events that have arrived (waits up to ``timeout`` s for one; [] on timeout)."""
        if not self.items:
            loop = asyncio.get_running_loop()
            self._deadline = loop.time() + timeout
            fut = self._waiter = loop.create_future()
            if self._timer is None:
                self._timer = loop.call_at(self._deadline, self._tick, loop)
            try:
                await fut
            finally:
                self._waiter = None
        items, self.items = self.items, []
        return items

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        w = self._waiter
        if w is None or w.done():
            return                   # nobody waits: the next take arms a timer again
        if loop.time() >= self._deadline:
            w.set_result(None)
        else:
            self._timer = loop.call_at(self._deadline, self._tick, loop)


class LoopSink:
    """Delivers events from any thread to :class:`Inbox` es on ``loop``: one
    ``call_soon_threadsafe`` per burst (per :func:`batch` block), not per event."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Inbox, object, float]] = []
        self._scheduled = False
        self.wakeups = 0          # loop wake-ups so far (one per engine step when batched)
        self.delivered = 0        # events delivered so far

    def listener(self, inbox: Inbox):
        """The callback a handle calls with each event (on the emitting thread)."""
        def post(ev) -> None:
            self._post(inbox, ev)
        return post

    def _post(self, inbox: Inbox, ev) -> None:
        with self._lock:
            self._pending.append((inbox, ev, time.perf_counter()))
        if getattr(_local, "depth", 0):
            _local.sinks.add(self)
        else:
            self._schedule()

    def _schedule(self) -> None:
        with self._lock:
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
        try:
            if getattr(self._loop, "_thread_id", None) == threading.get_ident():
                self._loop.call_soon(self._drain)        # posted on the loop itself: no wake-up
            else:
                self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:      # the loop is closed (server shutting down)
            with self._lock:
                self._scheduled = False
                self._pending.clear()

    def _drain(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
            self._scheduled = False
        self.wakeups += 1
        self.delivered += len(items)
        for inbox, ev, t in items:
            inbox._push(ev, t)


def sink_for(loop: asyncio.AbstractEventLoop) -> LoopSink:
    """The loop's sink (one per loop, made on first use)."""
    sink = getattr(loop, "_qwen_trt_sink", None)
    if sink is None:
        sink = LoopSink(loop)
        loop._qwen_trt_sink = sink     # type: ignore[attr-defined]
    return sink


async def handle_batches(handle, poll_s: float = 0.25, *,
                         inbox: Inbox | None = None) -> AsyncIterator[list]:
    """The events of ``handle`` on the running loop, in batches (see the module docstring).
    Ends after Finished / Failed; leaving early cancels the handle."""
    inbox = inbox if inbox is not None else Inbox()
    handle.listen(sink_for(asyncio.get_running_loop()).listener(inbox))
    try:
        while True:
            items = await inbox.take(poll_s)
            yield items
            if any(isinstance(ev, (Finished, Failed)) for ev in items):
                return
    finally:
        if not getattr(handle, "done", False):
            handle.cancel()


def merge_deltas(events: Iterable) -> list:
    """``events`` with each run of consecutive :class:`Delta` s joined into one (every field
    concatenated: the text, and any per-token tuples), so a request sends one chunk per
    wake-up however many steps it covers."""
    out: list = []
    run: list[Delta] = []

    def close() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            first = run[0]
            joined = {}
            for f in dataclasses.fields(first):
                parts = [getattr(d, f.name) for d in run]
                joined[f.name] = ("".join(parts) if isinstance(parts[0], str)
                                  else tuple(x for p in parts for x in p))
            out.append(dataclasses.replace(first, **joined))
        run.clear()

    for ev in events:
        if isinstance(ev, Delta):
            run.append(ev)
            continue
        close()
        out.append(ev)
    close()
    return out
