"""One engine, many callers: a process-wide service that runs one request at a time.

A backend serves a single request at a time, but a web app calls it from one thread per browser
session. :class:`InferenceService` owns the backend and one worker thread that takes requests from a
FIFO queue. Each request gets its own :class:`RequestHandle` with its own event queue and cancel
flag, so replies never interleave:

* :meth:`InferenceService.submit` returns at once; the handle reports its queue position while it
  waits ("waiting for the engine"), then text deltas, then the finished :class:`Reply`;
* :meth:`RequestHandle.cancel` drops a queued request, or stops a running one before its next
  token, so the engine is free for the next request at once;
* the worker never calls any UI code: it only fills the handle's queue.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Union

from qwen_trt.backends import BackendConfig, load_backend
from qwen_trt.backends.base import Backend
from qwen_trt.errors import QwenTrtError
from qwen_trt.chat.generation import ReplyStream
from qwen_trt.params import Reply, ReplyMetrics, SamplingParams

log = logging.getLogger(__name__)

RequestState = Literal["queued", "running", "done"]


class EngineFailedError(QwenTrtError):
    """The backend raised an unexpected error while generating."""


class ServiceClosedError(QwenTrtError):
    """The service was shut down (the model is being reloaded)."""


# Events a handle yields, in this order: Waiting* (while queued or before the first token),
# Started, Delta*, then exactly one of Finished / Failed.
@dataclass(frozen=True)
class Waiting:
    position: int        # requests ahead of this one (the running one included); 0 = running
    waited_s: float      # seconds since submit


@dataclass(frozen=True)
class Started:
    waited_s: float      # time spent in the queue


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Finished:
    reply: Reply


@dataclass(frozen=True)
class Failed:
    error: QwenTrtError


Event = Union[Waiting, Started, Delta, Finished, Failed]


class RequestHandle:
    """One caller's view of one request. Thread-safe: the worker writes, the caller reads."""

    def __init__(self, service: "InferenceService", request_id: int, prompt_ids: Sequence[int],
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

    # -- caller side ---------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Requests ahead of this one (the running one included); 0 once it runs or is done."""
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
        try:
            while True:
                try:
                    ev = self._events.get(timeout=poll_s)
                except queue.Empty:
                    yield Waiting(position=self.position, waited_s=time.monotonic() - self.submitted_at)
                    continue
                yield ev
                if isinstance(ev, (Finished, Failed)):
                    return
        finally:
            if not self._done.is_set():
                self.cancel()

    # -- worker side ---------------------------------------------------------------------------
    def _emit(self, ev: Event) -> None:
        if isinstance(ev, Delta):
            self._text.append(ev.text)
        elif isinstance(ev, Finished):
            self._result = ev.reply
            self.state = "done"
        elif isinstance(ev, Failed):
            self._result = ev.error
            self.state = "done"
        self._events.put(ev)
        if isinstance(ev, (Finished, Failed)):
            self._done.set()


@dataclass(frozen=True)
class ServiceStatus:
    busy: bool            # a request is running
    queued: int           # requests waiting behind it
    served: int           # requests finished since start


class InferenceService:
    """Owns one backend; runs submitted requests one at a time, in submission order."""

    def __init__(self, backend: Backend, *, name: str = "qwen-trt-engine") -> None:
        self.backend = backend
        self._queue: queue.Queue[RequestHandle | None] = queue.Queue()
        self._lock = threading.Lock()          # guards _waiting, _running, _served
        self._waiting: list[RequestHandle] = []
        self._running: RequestHandle | None = None
        self._served = 0
        self._ids = itertools.count(1)
        self._closed = False
        self._worker = threading.Thread(target=self._work, name=name, daemon=True)
        self._worker.start()

    @property
    def info(self):
        return self.backend.info

    @property
    def tokenizer(self):
        return self.backend.tokenizer

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               dropped_turns: int = 0) -> RequestHandle:
        """Queue a request and return its handle at once."""
        with self._lock:
            if self._closed:
                raise ServiceClosedError("The engine is shutting down: reload the page.")
            handle = RequestHandle(self, next(self._ids), prompt_ids, params, dropped_turns)
            self._waiting.append(handle)
        self._queue.put(handle)
        return handle

    def status(self) -> ServiceStatus:
        with self._lock:
            return ServiceStatus(busy=self._running is not None, queued=len(self._waiting),
                                 served=self._served)

    def close(self, timeout: float = 5.0, *, free_backend: bool = True) -> None:
        """Cancel everything, stop the worker and (unless told not to) free the backend."""
        with self._lock:
            self._closed = True
            pending = list(self._waiting) + ([self._running] if self._running else [])
        for h in pending:
            h.cancel()
        self._queue.put(None)
        self._worker.join(timeout)
        if free_backend:
            if self._worker.is_alive():   # never free the model under a running request
                log.warning("engine worker still busy after %.1f s; not freeing the backend",
                            timeout)
            else:
                self.backend.close()

    # -- internals -----------------------------------------------------------------------------
    def _position(self, handle: RequestHandle) -> int:
        with self._lock:
            if handle not in self._waiting:
                return 0
            ahead = [h for h in self._waiting[:self._waiting.index(handle)] if not h.cancelled]
            return len(ahead) + (1 if self._running is not None else 0)

    def _cancel(self, handle: RequestHandle) -> None:
        """A running request: stop the backend. A queued one: finish it now, never run it."""
        with self._lock:
            # Under the lock, so the backend's cancel flag is only ever set for this request;
            # the next request's stream() clears it when it begins.
            if self._running is handle:
                self.backend.cancel()
                return
            if handle not in self._waiting:
                return
            self._waiting.remove(handle)
        handle._emit(Finished(_cancelled_reply(handle)))

    def _work(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            with self._lock:
                if handle not in self._waiting:   # cancelled while queued: already finished
                    continue
                self._waiting.remove(handle)
                self._running = handle
                handle.started_at = time.monotonic()
                handle.state = "running"
            try:
                self._run(handle)
            finally:
                with self._lock:
                    self._running = None
                    self._served += 1

    def _run(self, handle: RequestHandle) -> None:
        if handle.cancelled:
            handle._emit(Finished(_cancelled_reply(handle)))
            return
        handle._emit(Started(waited_s=handle.waited_s))
        stream = None
        try:
            stream = ReplyStream(self.backend, handle.prompt_ids, handle.params,
                                 dropped_turns=handle.dropped_turns, cancel=handle._cancel)
            for delta in stream:
                handle._emit(Delta(delta))
            stream.close()
            handle._emit(Finished(stream.reply))
        except QwenTrtError as e:
            handle._emit(Failed(e))
        except Exception as e:  # a backend bug must not kill the worker or hang the caller
            log.exception("engine request %s failed", handle.id)
            handle._emit(Failed(EngineFailedError(
                f"The engine failed on this request ({type(e).__name__}: {e}); "
                f"try again, and check the server log if it keeps happening.".replace("\n", " "))))
        finally:
            if stream is not None:
                stream.close()


def _cancelled_reply(handle: RequestHandle) -> Reply:
    """The reply of a request cancelled before it reached the engine."""
    return Reply(text="", metrics=ReplyMetrics(prompt_tokens=len(handle.prompt_ids),
                                               finish_reason="cancelled"),
                 dropped_turns=handle.dropped_turns)


def start_service(cfg: BackendConfig) -> InferenceService:
    """Load the backend ``cfg`` names and serve it (the app caches one per process)."""
    return InferenceService(load_backend(cfg))
