"""Turn a backend's token stream into text deltas and a measured :class:`Reply`.

This is where metrics are taken (the same way for every backend): time to first token from the
call, decode rate after it, and the finish reason (stop / length / cancelled).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

from qwen_trt.backends.base import Backend
from qwen_trt.model.detokenizer import IncrementalDetokenizer
from qwen_trt.params import Reply, ReplyMetrics, SamplingParams, TokenLogprob
from qwen_trt.serving.events import Delta


class ReplyBuilder:
    """Token ids in, text deltas and a measured :class:`Reply` out: the one implementation of
    "token -> text + metrics", used by :class:`ReplyStream` (in process) and by the engine
    client (``qwen_trt.serving.client``, ids arriving from the worker process).

    Call :meth:`start` when the request is handed to the engine, :meth:`add` for each new id
    (returns the text that is safe to show; a stop id sets :attr:`stopped` and shows nothing),
    and :meth:`finish` once at the end (returns the held-back tail, fixes the finish reason).
    :meth:`delta` wraps text to show in a :class:`Delta` with the token ids (and logprobs)
    added since the last one: each generated token lands in the Delta whose text completes it.
    ``stop_ids``: :meth:`Backend.stop_ids` of the request (empty with ignore_eos).
    """

    def __init__(self, tokenizer, params: SamplingParams, stop_ids: frozenset[int],
                 prompt_tokens: int, dropped_turns: int = 0) -> None:
        self.params = params
        self._stop_ids = stop_ids
        self._detok = IncrementalDetokenizer(tokenizer)
        self._dropped = dropped_turns
        self.metrics = ReplyMetrics(prompt_tokens=prompt_tokens, finish_reason="cancelled")
        self.stopped = False
        self.finished = False
        self._t0 = time.perf_counter()
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []

    def start(self) -> None:
        """The request reached the engine: time to first token counts from here."""
        self._t0 = time.perf_counter()

    @property
    def done(self) -> bool:
        """A stop id arrived, or max_new_tokens did: nothing more will be shown."""
        return self.stopped or self.metrics.tokens >= self.params.max_new_tokens

    @property
    def pending(self) -> bool:
        """Tokens were added that no :meth:`delta` has carried yet."""
        return bool(self._ids)

    def delta(self, text: str) -> Delta:
        """``text`` as a :class:`Delta` carrying the tokens added since the last one."""
        d = Delta(text, tuple(self._ids), tuple(self._logprobs))
        self._ids, self._logprobs = [], []
        return d

    def add(self, token_id: int, logprob: TokenLogprob | None = None) -> str:
        """``logprob``: the token's, when the request asked for logprobs (a
        :class:`~qwen_trt.backends.base.SampledToken` id carries its own)."""
        now = time.perf_counter()
        m = self.metrics
        if self._t_first is None:
            self._t_first = now
            m.ttft_ms = (now - self._t0) * 1e3
        self._t_last = now
        m.tokens += 1
        if token_id in self._stop_ids:
            self.stopped = True
            return ""
        if logprob is None:
            logprob = getattr(token_id, "logprob", None)
        token_id = int(token_id)
        self._ids.append(token_id)
        if logprob is not None and self.params.logprobs is not None:
            self._logprobs.append(logprob)
        return self._detok.add(token_id)

    def finish(self, cancelled: bool = False) -> str:
        """End the reply; returns the text still held back ("" when cancelled mid-character).
        The reason: stop (a stop id), length (max_new_tokens), else cancelled."""
        if self.finished:
            return ""
        self.finished = True
        m = self.metrics
        tail = self._detok.flush() if self.stopped or not cancelled else ""
        if self.stopped:
            m.finish_reason = "stop"
        elif m.tokens >= self.params.max_new_tokens:
            m.finish_reason = "length"
        else:
            m.finish_reason = "cancelled"
        end = self._t_last if self._t_last is not None else time.perf_counter()
        m.total_ms = (end - self._t0) * 1e3
        if self._t_first is not None and m.tokens > 1:
            m.decode_tok_s = (m.tokens - 1) / max(self._t_last - self._t_first, 1e-9)
        return tail

    @property
    def text(self) -> str:
        return self._detok.text

    @property
    def reply(self) -> Reply:
        return Reply(text=self._detok.text, metrics=self.metrics, dropped_turns=self._dropped,
                     token_ids=list(self._detok.ids))


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
        self._build = ReplyBuilder(backend.tokenizer, params, backend.stop_ids(params),
                                   len(self._prompt_ids), dropped_turns)
        # This request's own flag: unlike the backend's, nothing clears it when a stream begins,
        # so a cancel that lands before the first token is never lost.
        self._cancel = cancel if cancel is not None else threading.Event()
        self._deltas = self._run()
        self._gen = (d.text for d in self._deltas if d.text)

    def __iter__(self) -> Iterator[str]:
        return self._gen

    def deltas(self) -> Iterator[Delta]:
        """Iterate instead of ``iter(stream)`` to get :class:`Delta` events (text plus the
        token ids and logprobs it completes) rather than bare text."""
        return self._deltas

    def __enter__(self) -> "ReplyStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._gen.close()
        self._deltas.close()
        self._build.finish(cancelled=True)   # no-op when the stream ran to its end

    def cancel(self) -> None:
        """Thread-safe: stop the backend before its next token (or before it starts)."""
        self._cancel.set()
        self._backend.cancel()

    @property
    def text(self) -> str:
        return self._build.text

    @property
    def reply(self) -> Reply:
        return self._build.reply

    def _run(self) -> Iterator[Delta]:
        b = self._build
        b.start()
        if self._cancel.is_set():          # cancelled before the engine was even asked
            b.finish(cancelled=True)
            return
        self._backend.check_request(self._prompt_ids, self.params)
        tokens = self._backend.stream(self._prompt_ids, self.params)
        try:
            for tok in tokens:
                delta = b.add(tok)
                if b.stopped:
                    break
                if delta:
                    yield b.delta(delta)
                if self._cancel.is_set():
                    break
        finally:
            tokens.close()   # stops device work; its teardown is not part of the metrics
        tail = b.finish(cancelled=self._cancel.is_set())
        if tail or b.pending:
            yield b.delta(tail)
