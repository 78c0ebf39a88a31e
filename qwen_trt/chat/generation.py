"""Turn a backend's token stream into text deltas and a measured :class:`Reply`.

This is where metrics are taken (the same way for every backend): time to first token from the
call, decode rate after it, and the finish reason (stop / length / cancelled).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

from qwen_trt.backends.base import Backend
from qwen_trt.chat.detokenizer import IncrementalDetokenizer
from qwen_trt.params import Reply, ReplyMetrics, SamplingParams


class ReplyStream:
    """Iterate to get text deltas; afterwards ``.reply`` holds the full text and metrics.

    Closing it early (``close()``, or ``break`` out of a ``with`` block) cancels the request
    and the reply is marked ``cancelled``.
    """

    def __init__(self, backend: Backend, prompt_ids: Sequence[int], params: SamplingParams,
                 dropped_turns: int = 0, cancel: threading.Event | None = None) -> None:
        self._backend = backend
        self.params = params
        self._prompt_ids = list(prompt_ids)
        self._detok = IncrementalDetokenizer(backend.tokenizer)
        self._dropped = dropped_turns
        self._metrics = ReplyMetrics(prompt_tokens=len(self._prompt_ids), finish_reason="cancelled")
        # This request's own flag: unlike the backend's, nothing clears it when a stream begins,
        # so a cancel that lands before the first token is never lost.
        self._cancel = cancel if cancel is not None else threading.Event()
        self._gen = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._gen

    def __enter__(self) -> "ReplyStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._gen.close()

    def cancel(self) -> None:
        """Thread-safe: stop the backend before its next token (or before it starts)."""
        self._cancel.set()
        self._backend.cancel()

    @property
    def text(self) -> str:
        return self._detok.text

    @property
    def reply(self) -> Reply:
        return Reply(text=self._detok.text, metrics=self._metrics, dropped_turns=self._dropped,
                     token_ids=list(self._detok.ids))

    def _run(self) -> Iterator[str]:
        m = self._metrics
        stop_ids = self._backend.stop_ids(self.params)   # empty with ignore_eos
        t0 = time.perf_counter()
        t_first = t_last = None
        if self._cancel.is_set():          # cancelled before the engine was even asked
            m.total_ms = 0.0
            return
        self._backend.check_request(self._prompt_ids, self.params)
        tokens = self._backend.stream(self._prompt_ids, self.params)
        last = None
        try:
            for tok in tokens:
                t_last = time.perf_counter()
                if t_first is None:
                    t_first = t_last
                    m.ttft_ms = (t_last - t0) * 1e3
                m.tokens += 1
                last = tok
                if tok in stop_ids:
                    break
                delta = self._detok.add(tok)
                if delta:
                    yield delta
                if self._cancel.is_set():
                    break
            stopped = last is not None and last in stop_ids
            if stopped or not self._cancel.is_set():
                tail = self._detok.flush()
                if tail:
                    yield tail
            if stopped:
                m.finish_reason = "stop"
            elif m.tokens >= self.params.max_new_tokens:
                m.finish_reason = "length"
            else:
                m.finish_reason = "cancelled"
        finally:
            tokens.close()   # stops device work; its teardown is not part of the metrics
            end = t_last if t_last is not None else time.perf_counter()
            m.total_ms = (end - t0) * 1e3
            if t_first is not None and m.tokens > 1:
                m.decode_tok_s = (m.tokens - 1) / max(t_last - t_first, 1e-9)
