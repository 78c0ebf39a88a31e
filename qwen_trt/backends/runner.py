"""What the worker process drives: a :class:`Runner` advances every admitted request by one step.

The worker (``qwen_trt.serving`` process side) owns one runner and loops::

    runner.add(...) / runner.abort(...)   # between steps, for requests that arrived / left
    for ev in runner.step(): ...          # new token ids per request, routed to the client

A runner never detokenizes and never measures: token ids go to the client, which turns them into
text (``qwen_trt.model.detokenizer``) and metrics, the same way for every backend. Implementations:

* ``SerialRunner`` (here): any :class:`~qwen_trt.backends.base.Backend`, one request at a time
  (the HF reference torch backend, the batch-1 fast decoder);
* the continuous-batching runner of the fast path (``qwen_trt.serving.scheduler``);
* the TensorRT-LLM executor (in-flight batching, ``qwen_trt.backends.trtllm_backend``).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from qwen_trt.errors import PromptTooLongError
from qwen_trt.params import SamplingParams, TokenLogprob

StepFinish = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class TokenEvent:
    """New token ids of one request after a step. ``finish`` set means the request has left the
    runner (its KV is freed); ``error`` carries one clear line when ``finish == "error"``."""

    request_id: int
    token_ids: tuple[int, ...] = ()
    finish: StepFinish | None = None
    error: str | None = None
    cached_tokens: int = 0          # prompt tokens served from the prefix cache (first event)
    logprobs: tuple[TokenLogprob, ...] = ()   # one per token id when params.logprobs is set


@dataclass(frozen=True)
class RunnerStats:
    """For /metrics, the bench and the UI."""

    running: int = 0                # requests in the batch
    waiting: int = 0                # admitted to the runner, not yet scheduled
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_hit_tokens: int = 0      # cumulative
    prompt_tokens: int = 0          # cumulative
    extra: dict = field(default_factory=dict)


class Runner(Protocol):
    """The worker-side engine loop contract (thread-confined: one thread calls every method)."""

    max_concurrency: int            # requests it can hold at once (1 = serial)

    def add(self, request_id: int, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Admit a request; its first tokens come from a later :meth:`step`."""

    def abort(self, request_id: int) -> None:
        """Drop a request now (free its KV); a final ``TokenEvent(finish="cancelled")`` follows."""

    def has_work(self) -> bool:
        """Whether :meth:`step` has anything to do."""

    def step(self) -> list[TokenEvent]:
        """Advance every scheduled request by one step (a decode token, or a prefill chunk)."""

    def stats(self) -> RunnerStats:
        ...


def generate(runner: Runner, prompt_ids: Sequence[int], params: SamplingParams,
             request_id: int = -1) -> Iterator[int]:
    """One request through ``runner`` alone (in-process use: tests, the bench's FIFO mode, a
    backend's ``stream`` once a runner holds its weights); yields token ids with the
    :class:`~qwen_trt.backends.base.Backend` contract."""
    runner.add(request_id, prompt_ids, params)
    done = False
    try:
        while not done:
            for ev in runner.step():
                if ev.request_id != request_id:
                    continue
                if ev.finish == "error":
                    raise PromptTooLongError(ev.error or "request failed")
                if ev.logprobs:
                    from qwen_trt.params import SampledToken

                    yield from map(SampledToken, ev.logprobs)
                else:
                    yield from ev.token_ids
                done = ev.finish is not None
    finally:
        if not done:
            runner.abort(request_id)
            runner.step()
