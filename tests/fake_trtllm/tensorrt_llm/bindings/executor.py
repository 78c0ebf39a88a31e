"""Fake ``tensorrt_llm.bindings.executor`` (the pybind/nanobind ``Executor`` and request types).

Mirrors the 1.x bindings as read in NVIDIA/TensorRT-LLM:

* ``Executor.enqueue_request(request) -> id``, ``enqueue_requests(requests) -> ids``,
  ``await_responses(timeout=None)`` (any ready responses, of every request),
  ``await_responses(id, timeout=None)`` / ``await_responses(ids, timeout=None)`` (only those),
  ``cancel_request(id)``, ``get_num_responses_ready(id=None)``, ``can_enqueue_requests()``,
  ``shutdown()``: cpp/tensorrt_llm/pybind/executor/executor.cpp:108-122 @03961722. Without a
  timeout ``await_responses`` blocks until a response is ready -- for ever on a finished id
  (NVIDIA/TensorRT-LLM:cpp/include/tensorrt_llm/executor/executor.h); the fake raises instead of hanging the test run.
* ``Response``: ``request_id``, ``has_error()``, ``error_msg``, ``result``. Reading ``result`` of
  an error response throws ("Cannot get the result for a response with an error",
  cpp/tensorrt_llm/executor/responseImpl.h ``getResult``; newer versions append the message at
  responseImpl.h:68-77 @3585984b); reading ``error_msg`` of a good one throws too.
* ``Result``: ``output_token_ids`` (per beam; with streaming only the new tokens, never the
  prompt), ``is_final``, ``sequence_index``.
* ``Request(input_token_ids, max_tokens, streaming, sampling_config, output_config, end_id,
  pad_id, stop_words, ...)`` and ``SamplingConfig(beam_width, top_k, top_p, temperature, seed,
  ...)``: the keyword names ModelRunnerCpp.generate passes (tensorrt_llm/runtime/
  model_runner_cpp.py @03832911).

The engine is scripted: one ``await_responses`` call runs one iteration in which up to
``max_batch_size`` queued requests (in-flight batching: later ones wait) each produce their next
chunk; responses of all requests pile up, interleaved, until awaited. Knobs (class attributes,
set by tests): ``script`` / ``script_for(prompt_ids)`` what a request generates, ``chunks``
tokens per response (cycled), ``include_end_id``, ``per_call`` responses handed out per call,
``error_after`` (every request fails after that many calls), ``fail_for(request) -> msg``,
``late_cancel_ack``; ``budget`` / ``allow(n)`` pause the engine and let it run n iterations.
``log`` records ``(request_id, tokens, is_final, error)`` in the order the
responses were handed out.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import tensorrt_llm


@dataclass
class SamplingConfig:
    beam_width: int = 1
    top_k: int | None = None
    top_p: float | None = None
    top_p_min: float | None = None
    top_p_reset_ids: int | None = None
    top_p_decay: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    beam_search_diversity_rate: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    early_stopping: int | None = None
    no_repeat_ngram_size: int | None = None
    num_return_sequences: int | None = None
    min_p: float | None = None
    beam_width_array: list | None = None


@dataclass
class OutputConfig:
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = False


@dataclass
class Request:
    input_token_ids: list[int]
    max_tokens: int
    streaming: bool = False
    sampling_config: SamplingConfig = field(default_factory=SamplingConfig)
    output_config: OutputConfig = field(default_factory=OutputConfig)
    end_id: int | None = None
    pad_id: int | None = None
    position_ids: list | None = None
    bad_words: list | None = None
    stop_words: list[list[int]] | None = None
    return_all_generated_tokens: bool = False
    kwargs: dict = field(default_factory=dict)

    def __init__(self, input_token_ids, max_tokens, streaming=False, sampling_config=None,
                 output_config=None, end_id=None, pad_id=None, position_ids=None,
                 bad_words=None, stop_words=None, return_all_generated_tokens=False, **kwargs):
        if not isinstance(input_token_ids, list) or not all(isinstance(t, int)
                                                            for t in input_token_ids):
            raise TypeError("input_token_ids must be a list of int (VecTokens)")
        self.input_token_ids = input_token_ids
        self.max_tokens = max_tokens
        self.streaming = streaming
        self.sampling_config = sampling_config or SamplingConfig()
        self.output_config = output_config or OutputConfig()
        self.end_id, self.pad_id = end_id, pad_id
        self.position_ids, self.bad_words, self.stop_words = position_ids, bad_words, stop_words
        self.return_all_generated_tokens = return_all_generated_tokens
        self.kwargs = kwargs


@dataclass
class Result:
    output_token_ids: list[list[int]]
    is_final: bool
    sequence_index: int = 0


class Response:
    def __init__(self, request_id: int, result: Result | None = None, error: str = ""):
        self.request_id = request_id
        self._result = result
        self._error = error

    def has_error(self) -> bool:
        return bool(self._error)

    def has_result(self) -> bool:
        return self._result is not None

    @property
    def result(self) -> Result:
        if self._error:
            raise RuntimeError("Cannot get the result for a response with an error")
        return self._result

    @property
    def error_msg(self) -> str:
        if not self._error:
            raise RuntimeError("Cannot get the error message for a response without error")
        return self._error


@dataclass
class _State:
    request: Request
    produced: list[int]
    sent: int = 0
    cancelled: bool = False
    final_sent: bool = False
    enqueued_at: int = 0


class BlockingAwaitError(AssertionError):
    """await_responses without a timeout would block for ever here."""


class Executor:
    script: list[int] = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    script_for = None                  # callable(prompt_ids) -> tokens; overrides script
    chunks: list[int] = [1]            # tokens per response, cycled
    include_end_id: bool = True
    per_call: int | None = None        # responses handed out per await call (None: all ready)
    error_after: int | None = None     # every live request gets an error response after this
    fail_for = None                    # callable(request) -> error message or None
    late_cancel_ack: bool = False      # a cancelled request's final response comes only after
                                       # the next request is enqueued

    def __init__(self, max_batch_size: int = 2048, max_input_len: int = 1024,
                 max_seq_len: int = 2048):
        self.max_batch_size = max_batch_size
        self.max_input_len, self.max_seq_len = max_input_len, max_seq_len
        self.requests: dict[int, _State] = {}
        self.next_id = 1
        self.calls = 0
        self.iterations = 0
        self.timeouts: list = []
        self.cancelled: list[int] = []
        self.log: list[tuple[int, tuple[int, ...], bool, str]] = []
        self.max_in_flight = 0
        self.shut = False
        self.budget: int | None = None     # iterations left to run (None: free-running)
        self._ready: list[Response] = []
        self._cv = threading.Condition()

    # ------------------------------------------------------------------ enqueue / cancel
    def can_enqueue_requests(self) -> bool:
        return not self.shut

    def enqueue_request(self, request: Request) -> int:
        return self.enqueue_requests([request])[0]

    def enqueue_requests(self, requests) -> list[int]:
        with self._cv:
            if self.shut:
                raise RuntimeError("Shutdown called, cannot enqueue requests")
            ids = []
            for r in requests:
                if not isinstance(r, Request):
                    raise TypeError(f"enqueue_request(): incompatible argument {r!r}")
                if len(r.input_token_ids) > self.max_input_len:
                    raise RuntimeError(f"The number of input tokens ({len(r.input_token_ids)}) "
                                       f"exceeds the max input length ({self.max_input_len})")
                rid, self.next_id = self.next_id, self.next_id + 1
                self.requests[rid] = _State(r, self._generate(r), enqueued_at=self.calls)
                ids.append(rid)
            tensorrt_llm.CALLS.append(("enqueue_requests", {"ids": ids, "requests": requests}))
            self._cv.notify_all()
            return ids

    def _generate(self, r: Request) -> list[int]:
        """What the model would produce: script until end_id / a stop word / max_tokens."""
        script = self.script_for(r.input_token_ids) if self.script_for else self.script
        out, stops = [], {tuple(w) for w in (r.stop_words or [])}
        for tok in script:
            if len(out) == r.max_tokens:
                break
            if tok == r.end_id:
                if self.include_end_id:
                    out.append(tok)
                break
            out.append(tok)
            if (tok,) in stops:
                break
        return out

    def cancel_request(self, id=None):
        with self._cv:
            tensorrt_llm.CALLS.append(("cancel_request", {"id": id}))
            self.cancelled.append(id)
            if id in self.requests:
                self.requests[id].cancelled = True
            self._cv.notify_all()

    # ------------------------------------------------------------------ the engine loop
    def _iterate(self) -> None:
        """One in-flight batching iteration: every scheduled live request advances."""
        live = [(rid, s) for rid, s in self.requests.items() if not s.final_sent]
        scheduled = live[:self.max_batch_size]
        self.max_in_flight = max(self.max_in_flight, len(scheduled))
        if not scheduled:
            return
        if self.budget is not None:
            if self.budget <= 0:
                return
            self.budget -= 1
        self.iterations += 1
        k = self.iterations % len(scheduled)
        for rid, s in scheduled[k:] + scheduled[:k]:          # interleave across iterations
            if s.cancelled:
                if self.late_cancel_ack and rid == self.next_id - 1:
                    continue   # held back until another request is enqueued
                s.final_sent = True
                self._ready.append(Response(rid, Result([[]], is_final=True)))
                continue
            msg = self.fail_for(s.request) if self.fail_for else None
            if msg is None and self.error_after is not None and self.calls > self.error_after:
                msg = "Encountered an error in forwardAsync function: CUDA out of memory"
            if msg:
                s.final_sent = True
                self._ready.append(Response(rid, error=msg))
                continue
            if not s.request.streaming:   # one final response; the prompt unless excluded
                new, s.sent = s.produced[s.sent:], len(s.produced)
                if not s.request.output_config.exclude_input_from_output:
                    new = list(s.request.input_token_ids) + new
            else:
                n = self.chunks[(self.iterations - 1) % len(self.chunks)]
                new = s.produced[s.sent:s.sent + n]
                s.sent += len(new)
            s.final_sent = s.sent >= len(s.produced)
            if s.request.streaming or s.final_sent:
                self._ready.append(Response(rid, Result([list(new)], is_final=s.final_sent)))

    @staticmethod
    def _parse(args, kwargs):
        timeout, ids = kwargs.pop("timeout", None), None
        if "id" in kwargs:
            ids = [kwargs.pop("id")]
        if "ids" in kwargs:
            ids = list(kwargs.pop("ids"))
        if kwargs:
            raise TypeError(f"await_responses(): unexpected arguments {sorted(kwargs)}")
        if args:
            first, rest = args[0], args[1:]
            if isinstance(first, int) and not isinstance(first, bool):
                ids, timeout = [first], (rest[0] if rest else timeout)
            elif isinstance(first, list):
                ids, timeout = list(first), (rest[0] if rest else timeout)
            elif first is None or isinstance(first, timedelta):
                timeout = first
            else:
                raise TypeError(f"await_responses(): incompatible argument {first!r}")
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError("timeout must be a datetime.timedelta (std::chrono::milliseconds)")
        return timeout, ids

    def await_responses(self, *args, **kwargs) -> list[Response]:
        timeout, ids = self._parse(args, dict(kwargs))
        with self._cv:
            self.calls += 1
            self.timeouts.append(timeout)
            self._iterate()
            picked = [r for r in self._ready if ids is None or r.request_id in ids]
            if not picked:
                if timeout is None:
                    raise BlockingAwaitError(
                        "await_responses() without a timeout and nothing ready: the real "
                        "executor would block here for ever")
                self._cv.wait(min(timeout.total_seconds(), 0.05))
                return []
            if self.per_call is not None:
                picked = picked[:self.per_call]
            for r in picked:
                self._ready.remove(r)
                err = r._error
                res = r._result
                self.log.append((r.request_id, tuple(res.output_token_ids[0]) if res else (),
                                 bool(res.is_final) if res else True, err))
            return picked

    def allow(self, n: int) -> None:
        """Test hook: let ``n`` more engine iterations run (after ``budget = 0`` paused it)."""
        with self._cv:
            self.budget = (self.budget or 0) + n
            self._cv.notify_all()

    def get_num_responses_ready(self, id=None) -> int:
        with self._cv:
            return sum(1 for r in self._ready if id is None or r.request_id == id)

    def shutdown(self):
        with self._cv:
            self.shut = True
            self._cv.notify_all()
        time.sleep(0)


FakeExecutor = Executor
