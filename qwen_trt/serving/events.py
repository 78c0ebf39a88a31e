"""What a caller of the engine sees, whichever service runs it (in process or the worker process).

A request's :class:`RequestHandle` yields events in this order: :class:`Waiting`* (while queued,
or while the engine (re)starts), :class:`Started`, :class:`Delta`*, then exactly one of
:class:`Finished` / :class:`Failed`. Both :class:`~qwen_trt.serving.service.InferenceService`
(in process) and :class:`~qwen_trt.serving.client.WorkerClient` (worker process) hand out these
handles, so the app, the CLI and the HTTP API work with either.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, Union

from qwen_trt.errors import QwenTrtError
from qwen_trt.params import Reply, ReplyMetrics, SamplingParams, TokenLogprob

RequestState = Literal["queued", "running", "done"]
# The engine's state as status() and Waiting.engine report it.
WorkerState = Literal["loading", "ready", "restarting", "stopped", "failed", "closed"]


class RequestFailedError(QwenTrtError):
    """The backend raised an unexpected error while generating."""


class ServiceClosedError(QwenTrtError):
    """The service was shut down (the model is being reloaded)."""


class WorkerStoppedError(RequestFailedError):
    """The engine process died (killed, out of memory, a CUDA error); the next request
    restarts it."""


class ModelLoadError(QwenTrtError):
    """The engine process could not load the model; the message is the load error's own line."""


@dataclass(frozen=True)
class Waiting:
    position: int        # requests ahead of this one (running ones included); 0 = none
    waited_s: float      # seconds since submit
    engine: str = ""     # while the worker is not ready: e.g. "Restarting the worker: loading…"


@dataclass(frozen=True)
class Started:
    waited_s: float      # time spent in the queue


@dataclass(frozen=True)
class Delta:
    """New reply text, and the generated tokens whose text it completes (every generated
    token is in exactly one Delta; the stop token in none); ``logprobs``, one per token id,
    only when the request's ``params.logprobs`` is set."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    reply: Reply


@dataclass(frozen=True)
class Failed:
    error: QwenTrtError


Event = Union[Waiting, Started, Delta, Finished, Failed]


@dataclass(frozen=True)
class ServiceStatus:
    busy: bool                      # a request is running
    queued: int                     # requests waiting for a free slot
    served: int                     # requests finished since start
    state: WorkerState = "ready"
    stage: str = ""                 # the latest load / warm-up line while not ready
    running: int = 0                # requests in the engine now
    max_concurrency: int = 1        # requests the engine holds at once
    cached_tokens: int = 0          # prompt tokens served from the prefix cache (cumulative)
    prompt_tokens: int = 0          # prompt tokens submitted to the engine (cumulative)
    restarts: int = 0               # engine process restarts after a crash
    runner: dict = field(default_factory=dict)   # the runner's RunnerStats, as a dict

    @property
    def accepting(self) -> bool:
        """Whether the service takes requests now (False while loading, restarting, dead or
        closed): what ``/health`` reports."""
        return self.state == "ready"


class _Owner(Protocol):
    def _position(self, handle: "RequestHandle") -> int: ...
    def _cancel(self, handle: "RequestHandle") -> None: ...


class RequestHandle:
    """One caller's view of one request. Thread-safe: the service writes, the caller reads."""

    def __init__(self, service: _Owner, request_id: int, prompt_ids: Sequence[int],
                 params: SamplingParams, dropped_turns: int) -> None:
        self.id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.dropped_turns = dropped_turns
        self.submitted_at = time.monotonic()
        self.started_at: float | None = None
        self.state: RequestState = "queued"
        self._service = service
        self._events: queue.Queue[Event] = queue.Queue()
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._text: list[str] = []
        self._result: Reply | QwenTrtError | None = None
        self._listener = None            # set by listen(): events go there, not to events()
        self._listen_lock = threading.Lock()

    # -- caller side ---------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Requests ahead of this one (the running ones included); 0 once it runs or is done."""
        return self._service._position(self)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def text(self) -> str:
        """The reply text generated so far (complete once :attr:`done`)."""
        return "".join(self._text)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def waited_s(self) -> float:
        """Time spent waiting for the engine (so far, if still queued)."""
        end = self.started_at if self.started_at is not None else time.monotonic()
        return end - self.submitted_at

    def cancel(self) -> None:
        """Drop the request if queued, or stop it before its next token if running."""
        self._cancel.set()
        self._service._cancel(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request is finished, failed or cancelled; False on timeout."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> Reply:
        """The finished reply (raises the request's QwenTrtError, or TimeoutError)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} still running after {timeout} s")
        if isinstance(self._result, QwenTrtError):
            raise self._result
        assert self._result is not None
        return self._result

    def events(self, poll_s: float = 0.1) -> Iterator[Event]:
        """Events for this request. While nothing arrives it yields a :class:`Waiting` every
        ``poll_s`` seconds, so a UI thread gets a chance to update (and be interrupted).
        Closing the iterator early cancels the request."""
        note = getattr(self._service, "_engine_note", None)
        try:
            while True:
                try:
                    ev = self._events.get(timeout=poll_s)
                except queue.Empty:
                    yield Waiting(position=self.position,
                                  waited_s=time.monotonic() - self.submitted_at,
                                  engine=note() if note is not None and not self.done else "")
                    continue
                yield ev
                if isinstance(ev, (Finished, Failed)):
                    return
        finally:
            if not self._done.is_set():
                self.cancel()

    def listen(self, fn) -> None:
        """Hand every event to ``fn(event)`` instead of :meth:`events` (called on the thread that
        emits it, so ``fn`` must be quick and never block); events already emitted go first, in
        order. An asyncio consumer uses this (:mod:`qwen_trt.serving.async_events`)."""
        with self._listen_lock:
            while True:
                try:
                    fn(self._events.get_nowait())
                except queue.Empty:
                    break
            self._listener = fn

    # -- service side --------------------------------------------------------------------------
    def _emit(self, ev: Event) -> None:
        if self._done.is_set():          # finished already (e.g. cancelled): nothing follows
            return
        if isinstance(ev, Delta):
            self._text.append(ev.text)
        elif isinstance(ev, Finished):
            self._result = ev.reply
            self.state = "done"
        elif isinstance(ev, Failed):
            self._result = ev.error
            self.state = "done"
        with self._listen_lock:
            if self._listener is not None:
                self._listener(ev)
            else:
                self._events.put(ev)
        if isinstance(ev, (Finished, Failed)):
            self._done.set()


def cancelled_reply(handle: RequestHandle) -> Reply:
    """The reply of a request cancelled before it reached the engine."""
    return Reply(text="", metrics=ReplyMetrics(prompt_tokens=len(handle.prompt_ids),
                                               finish_reason="cancelled"),
                 dropped_turns=handle.dropped_turns)


def queue_position(waiting: Sequence[RequestHandle], handle: RequestHandle, running: bool) -> int:
    """:attr:`RequestHandle.position` for a service holding ``waiting`` in order (under its
    lock): the requests still queued ahead (cancelled ones skipped), plus one while the engine
    runs any; 0 once ``handle`` has left the queue."""
    if handle not in waiting:
        return 0
    ahead = sum(1 for h in waiting[:waiting.index(handle)] if not h.cancelled)
    return ahead + (1 if running else 0)
