"""SerialRunner: any :class:`~qwen_trt.backends.base.Backend` as a
:class:`~qwen_trt.backends.runner.Runner`.

One request at a time (``max_concurrency = 1``): :meth:`step` advances the running request's
``backend.stream`` generator by one token; the next request starts when it ends. Requests added
while one runs wait here in FIFO order (the client normally keeps at most one here).
:meth:`abort` closes the generator, which stops device work before the next token.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from qwen_trt.backends.base import Backend
from qwen_trt.errors import QwenTrtError, error_detail
from qwen_trt.params import SamplingParams
from qwen_trt.backends.runner import RunnerStats, TokenEvent

log = logging.getLogger(__name__)


class FatalDeviceError(RuntimeError):
    """The device is in a state no later request can use (a CUDA error): the worker must restart."""


def error_line(e: BaseException) -> str:
    """One line for a request that failed in the backend."""
    if isinstance(e, QwenTrtError):
        return str(e).replace("\n", " ")
    return (f"The backend failed on this request ({error_detail(e)}); try again, and check the "
            f"server log if it keeps happening.")


def is_fatal(e: BaseException) -> bool:
    """A CUDA error (illegal address, launch failure, ...) poisons the CUDA context for good;
    out-of-memory does not."""
    text = str(e)
    return "CUDA error" in text and "out of memory" not in text


@dataclass
class _Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    gen: Iterator[int] | None = None
    tokens: int = 0


class SerialRunner:
    """Runs one request at a time on ``backend``, one token per :meth:`step`."""

    max_concurrency = 1

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._queue: deque[_Request] = deque()
        self._running: _Request | None = None
        self._done: list[TokenEvent] = []     # finish events to report at the next step
        self._prompt_tokens = 0

    def add(self, request_id: int, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        try:
            self.backend.check_request(prompt_ids, params)   # the one admission check
        except QwenTrtError as e:
            self._done.append(TokenEvent(request_id, finish="error", error=str(e)))
            return
        self._queue.append(_Request(request_id, list(prompt_ids), params,
                                    self.backend.stop_ids(params)))
        self._prompt_tokens += len(prompt_ids)

    def abort(self, request_id: int) -> None:
        if self._running is not None and self._running.request_id == request_id:
            self._close(self._running)
            self._running = None
        else:
            kept = [r for r in self._queue if r.request_id != request_id]
            if len(kept) == len(self._queue):
                return                       # finished already: its final event went out
            self._queue = deque(kept)
        self._done.append(TokenEvent(request_id, finish="cancelled"))

    def has_work(self) -> bool:
        return bool(self._done or self._running or self._queue)

    def step(self) -> list[TokenEvent]:
        events, self._done = self._done, []
        if self._running is None and self._queue:
            self._running = self._queue.popleft()
        req = self._running
        if req is None:
            return events
        try:
            if req.gen is None:
                req.gen = iter(self.backend.stream(req.prompt_ids, req.params))
            tok = next(req.gen)
        except StopIteration:                # the backend ended early (e.g. context full)
            events.append(self._finish(req, (), "length"))
            return events
        except Exception as e:  # noqa: BLE001 - one line to the client; the runner goes on
            if is_fatal(e):
                raise FatalDeviceError(error_detail(e)) from e
            if not isinstance(e, QwenTrtError):
                log.exception("request %s failed in the backend", req.request_id)
            events.append(self._finish(req, (), "error", error_line(e)))
            return events
        req.tokens += 1
        lp = getattr(tok, "logprob", None)          # a SampledToken when logprobs are on
        lps = (lp,) if lp is not None else ()
        tok = int(tok)
        if tok in req.stop_ids:
            events.append(self._finish(req, (tok,), "stop", logprobs=lps))
        elif req.tokens >= req.params.max_new_tokens:
            events.append(self._finish(req, (tok,), "length", logprobs=lps))
        else:
            events.append(TokenEvent(req.request_id, (tok,), logprobs=lps))
        return events

    def stats(self) -> RunnerStats:
        return RunnerStats(running=int(self._running is not None), waiting=len(self._queue),
                           prompt_tokens=self._prompt_tokens)

    def _finish(self, req: _Request, ids: tuple[int, ...], finish, error: str | None = None,
                logprobs: tuple = ()):
        self._close(req)
        self._running = None
        return TokenEvent(req.request_id, ids, finish=finish, error=error, logprobs=logprobs)

    @staticmethod
    def _close(req: _Request) -> None:
        if req.gen is not None:
            close = getattr(req.gen, "close", None)
            if close is not None:
                close()                      # stops device work before the next token
