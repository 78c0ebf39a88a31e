"""Turn a backend's token stream into text deltas and a measured :class:`Reply`.

This is where metrics are taken (the same way for every backend): time to first token from the
call, decode rate after it, and the finish reason (stop / length / cancelled).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

from qwen_trt.backends.base import Backend
from qwen_trt.chat.template import ENDOFTEXT, IM_END
from qwen_trt.chat.detokenizer import IncrementalDetokenizer
from qwen_trt.params import Reply, ReplyMetrics, SamplingParams


def default_stop_ids(tokenizer) -> tuple[int, ...]:
    """``<|im_end|>`` and ``<|endoftext|>`` (whichever the tokenizer has), plus its eos."""
    ids: list[int] = []
    for tok in (IM_END, ENDOFTEXT):
        tid = tokenizer.convert_tokens_to_ids(tok)
        known = isinstance(tid, int) and tokenizer.convert_ids_to_tokens(tid) == tok
        if known and tid not in ids:
            ids.append(tid)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


def resolve_stop_ids(params: SamplingParams, tokenizer) -> SamplingParams:
    """Fill in the default stop ids when the caller gave none."""
    if params.stop_token_ids:
        return params
    return replace(params, stop_token_ids=default_stop_ids(tokenizer))


class ReplyStream:
    """Iterate to get text deltas; afterwards ``.reply`` holds the full text and metrics.

    Closing it early (``close()``, or ``break`` out of a ``with`` block) cancels the request
    and the reply is marked ``cancelled``.
    """

    def __init__(self, backend: Backend, prompt_ids: Sequence[int], params: SamplingParams,
                 dropped_turns: int = 0, cancel: threading.Event | None = None) -> None:
        self._backend = backend
        self.params = resolve_stop_ids(params, backend.tokenizer)
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
        stop_ids = set(self.params.stop_token_ids)
        t0 = time.perf_counter()
        t_first = t_last = None
        if self._cancel.is_set():          # cancelled before the engine was even asked
            m.total_ms = 0.0
            return
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
                if tok in stop_ids and not self.params.ignore_eos:
                    break
                delta = self._detok.add(tok)
                if delta:
                    yield delta
                if self._cancel.is_set():
                    break
            stopped = last is not None and last in stop_ids and not self.params.ignore_eos
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
