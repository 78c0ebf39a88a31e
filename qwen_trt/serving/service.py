"""One engine, many callers. :func:`start_service` runs the engine in its own process by default
(:class:`qwen_trt.serving.client.WorkerClient`); :class:`InferenceService` here is the in-process
mode (``QWEN_TRT_WORKER=inline``): the backend in this process, one request at a time.

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
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from qwen_trt import settings
from qwen_trt.backends import BackendConfig, load_backend
from qwen_trt.backends.base import Backend, BackendInfo
from qwen_trt.serving.generation import ReplyStream
from qwen_trt.errors import ConfigError, QwenTrtError
from qwen_trt.params import SamplingParams
from qwen_trt.serving.events import (Delta, RequestFailedError, Failed, Finished, RequestHandle,
                                     ServiceClosedError, ServiceStatus, Started, cancelled_reply,
                                     queue_position)
from qwen_trt.serving.session import PromptPlan

log = logging.getLogger(__name__)


@runtime_checkable
class Service(Protocol):
    """What every front end (the app, the CLI, the HTTP API) talks to, whichever of the three
    services runs the model: :class:`InferenceService` (in process), :class:`WorkerClient`
    (the worker process, :mod:`qwen_trt.serving.client`) or :class:`OpenAIService` (a remote
    OpenAI-compatible server, :mod:`qwen_trt.serving.remote`)."""

    @property
    def info(self) -> BackendInfo: ...

    @property
    def tokenizer(self): ...

    def submit_plan(self, plan: PromptPlan, params: SamplingParams) -> RequestHandle:
        """Queue a chat prompt (its token ids to the local backend, its messages to a remote one)."""

    def status(self) -> ServiceStatus:
        """The one place a caller learns whether the service takes requests (``accepting``)."""

    def close(self, timeout: float = 5.0) -> None: ...

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
                raise ServiceClosedError("The model service is shutting down: reload the page.")
            handle = RequestHandle(self, next(self._ids), prompt_ids, params, dropped_turns)
            self._waiting.append(handle)
        self._queue.put(handle)
        return handle

    def submit_plan(self, plan: PromptPlan, params: SamplingParams) -> RequestHandle:
        return self.submit(plan.ids, params, plan.dropped_turns)

    def status(self) -> ServiceStatus:
        with self._lock:
            state = ("closed" if self._closed else "ready" if self._worker.is_alive()
                     else "failed")
            return ServiceStatus(busy=self._running is not None, queued=len(self._waiting),
                                 served=self._served, running=int(self._running is not None),
                                 state=state)

    @property
    def closed(self) -> bool:
        return self._closed

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
                log.warning("the service thread still busy after %.1f s; not freeing the backend",
                            timeout)
            else:
                self.backend.close()

    # -- internals -----------------------------------------------------------------------------
    def _position(self, handle: RequestHandle) -> int:
        with self._lock:
            return queue_position(self._waiting, handle, self._running is not None)

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
        handle._emit(Finished(cancelled_reply(handle)))

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
            handle._emit(Finished(cancelled_reply(handle)))
            return
        handle._emit(Started(waited_s=handle.waited_s))
        stream = None
        try:
            stream = ReplyStream(self.backend, handle.prompt_ids, handle.params,
                                 dropped_turns=handle.dropped_turns, cancel=handle._cancel)
            for delta in stream.deltas():
                handle._emit(delta)
            stream.close()
            handle._emit(Finished(stream.reply))
        except QwenTrtError as e:
            handle._emit(Failed(e))
        except Exception as e:  # a backend bug must not kill the worker or hang the caller
            log.exception("request %s failed", handle.id)
            handle._emit(Failed(RequestFailedError(
                f"The backend failed on this request ({type(e).__name__}: {e}); "
                f"try again, and check the server log if it keeps happening.".replace("\n", " "))))
        finally:
            if stream is not None:
                stream.close()


WORKER_ENV = "QWEN_TRT_WORKER"       # "process" (default) or "inline"
WORKER_MODES = ("process", "inline")

_current = None                       # the engine of this server process (process mode)
_current_lock = threading.Lock()


def worker_mode(mode: str | None = None) -> str:
    """``process`` (the engine in its own process, the default) or ``inline`` (in this process,
    a thread: tests that patch the backend, debugging); ``$QWEN_TRT_WORKER`` when not given."""
    mode = (mode or settings.raw(WORKER_ENV) or "process").strip().lower()
    if mode not in WORKER_MODES:
        raise ConfigError(f"{WORKER_ENV} must be one of {', '.join(WORKER_MODES)}, got {mode!r}")
    return mode


def start_service(cfg: BackendConfig, *, mode: str | None = None, echo=None,
                  wait: bool = True, refuse_slow: bool = False, kv_events=None):
    """Load the backend ``cfg`` names and serve it; blocks until it is ready (load errors are
    raised as one-line :class:`QwenTrtError`). The app caches one per process.

    ``wait=False`` (the engine process only): return once the engine process is started;
    the caller loads its own parts meanwhile, then calls ``wait_ready()`` (``qwen-trt serve``:
    the HTTP server's imports overlap the engine's load). A local model folder's tokenizer is
    read here while the engine loads.

    One engine process per server process: starting another stops the previous one first, so
    two engines never share a GPU by accident.

    ``refuse_slow``: a load whose fast path fell back to much slower kernels is a load error
    (:func:`qwen_trt.backends.kernel_paths.slow_fallback_line`; ``qwen-trt serve`` without
    ``--allow-slow-fallback``). ``kv_events`` (a
    :class:`~qwen_trt.serving.kv_events.KvEventsConfig`): the engine process publishes them."""
    if worker_mode(mode) == "inline":
        if kv_events is not None:
            raise ConfigError("--kv-events needs the worker in its own process "
                              "(QWEN_TRT_WORKER=process, the default).")
        service = InferenceService(load_backend(cfg))
        if refuse_slow:
            from qwen_trt.backends.kernel_paths import SlowFallbackError, slow_fallback_line

            line = slow_fallback_line(service.info)
            if line:
                service.close()
                raise SlowFallbackError(line)
        return service
    from qwen_trt.serving.client import WorkerClient
    from qwen_trt.serving.preflight import preflight

    preflight(cfg)        # a missing folder or broken checkpoint: at once, not after torch loads

    global _current
    with _current_lock:
        if _current is not None and not _current.closed:
            log.info("stopping the previous worker process before starting another")
            _current.close()
        # echo: where the engine's stage lines go (stderr by default; the app also shows them)
        _current = WorkerClient(_spec(cfg, kv_events), wait=wait,
                                tokenizer_hint=_local_folder(cfg), refuse_slow=refuse_slow,
                                **({"echo": echo} if echo is not None else {}))
        return _current


def _spec(cfg: BackendConfig, kv_events=None):
    """The worker process's spec: ``cfg``, loaded by QWEN_TRT_TEST_LOADER when a test names one
    (a fake whose load is slow or crashes), else by the real loader; ``kv_events``: it
    publishes them."""
    from qwen_trt import settings
    from qwen_trt.serving.worker import WorkerSpec

    loader = settings.get("QWEN_TRT_TEST_LOADER")
    return (WorkerSpec(cfg, loader=loader, kv_events=kv_events) if loader
            else WorkerSpec(cfg, kv_events=kv_events))


def _local_folder(cfg: BackendConfig) -> str | None:
    """``--model`` as the folder the engine will name as its tokenizer's, when it is one."""
    from pathlib import Path

    if not cfg.model:
        return None
    path = Path(cfg.model).expanduser()
    return str(path) if path.is_dir() else None


def start_service_for(cfg: BackendConfig, echo=None) -> Service:
    """The service a :class:`~qwen_trt.backends.BackendConfig` names: a remote OpenAI-compatible
    server for ``backend="openai"``, else this machine's engine (:func:`start_service`)."""
    if cfg.backend == "openai":       # BackendConfig made sure it has a base_url
        from qwen_trt.serving.remote import OpenAIConfig, OpenAIService

        return OpenAIService(OpenAIConfig(base_url=cfg.base_url, api_key=cfg.api_key,
                                          model=cfg.model, max_seq_len=cfg.max_seq_len))
    return start_service(cfg, echo=echo)     # echo: where the engine's stage lines go
