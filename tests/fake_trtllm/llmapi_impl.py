"""The fake LLM API (PyTorch backend) shared by both fake installs: ``LLM``, ``SamplingParams``,
``KvCacheConfig``, ``RequestOutput`` / ``CompletionOutput`` and ``RequestError``.

Mirrors NVIDIA/TensorRT-LLM as read (stored snapshots; the commit each was read at):

* ``LLM(model, tokenizer=None, tokenizer_mode='auto', skip_tokenizer_init=False,
  trust_remote_code=False, tensor_parallel_size=1, dtype='auto', revision=None,
  tokenizer_revision=None, **kwargs)``: tensorrt_llm/llmapi/llm.py @4c05a748 (``BaseLLM``,
  ``_TorchLLM``, ``LLM``). A keyword that is no field of the args class is
  ``ValueError("LLM got invalid argument: <key>")``; a TensorRT-only one (``build_config``...)
  is the ValueError that says to use ``tensorrt_llm._tensorrt_engine.LLM``.
* ``generate_async(inputs, sampling_params=None, lora_request=None,
  prompt_adapter_request=None, streaming=False, kv_cache_retention_config=None,
  disaggregated_params=None, _postproc_params=None, scheduling_params=None, cache_salt=None)``
  (same file): ``RuntimeError("LLM is shutting down")`` after ``shutdown()``; token-id inputs
  are used as they are; ``_prepare_sampling_params`` fills ``end_id`` from the tokenizer when it
  is None; ``_check_arguments`` on the PyTorch backend refuses a prompt longer than
  ``max_num_tokens`` unless ``enable_chunked_prefill`` (ValueError "The sum of prompt length
  ... should not exceed max_num_tokens").
* ``SamplingParams``: a ``dataclass(slots=True, kw_only=True)`` whose fields and defaults
  (``max_tokens`` 32, ``end_id``/``pad_id`` None, ``stop_token_ids``,
  ``include_stop_str_in_output`` False, ``ignore_eos``, ``detokenize``, ...) and ``_validate``
  follow tensorrt_llm/sampling_params.py @000a01de; an unknown keyword is a TypeError.
* ``KvCacheConfig``: a strict pydantic model (``StrictBaseModel``: unknown fields refused) with
  ``enable_block_reuse=True``, ``max_tokens``, ``free_gpu_memory_fraction`` (0.9, in [0, 1]),
  ``dtype``...:
  tensorrt_llm/llmapi/llm_args.py (stored snapshot, ``class KvCacheConfig(StrictBaseModel,
  PybindMirror)``); the LLM args' ``kv_cache_config``, ``enable_chunked_prefill``,
  ``max_batch_size``, ``max_num_tokens``, ``max_seq_len`` fields (same file).
* ``RequestOutput`` (``GenerationResult``): tensorrt_llm/executor/result.py @005bc848. The
  queue is an ``AsyncQueue`` only when the result was made with an event loop running
  (``has_event_loop()``); ``async for`` on one made without asserts ("The asyncio event loop
  was not present during initialization, so async operations are not available."). Each
  response extends ``outputs[0].token_ids``; ``token_ids_diff`` is what it added;
  ``finished`` is the response's ``is_final``; finish reasons ``END_ID``/``STOP_WORDS`` ->
  ``'stop'`` (a stop word is cut off ``token_ids`` unless ``include_stop_str_in_output``),
  ``LENGTH`` -> ``'length'``, ``CANCELLED`` -> ``'cancelled'``; an error response raises
  ``RequestError`` (tensorrt_llm/executor/utils.py, raised by the executor's background error
  handler) from the iteration. ``abort()`` asks the executor to abort the request
  (``abort_request(id)``); its final response then comes with ``'cancelled'``.

The engine is scripted like the fake executor (class attributes of :class:`FakePyExecutor`):
``script`` / ``script_for(prompt_ids)``, ``chunks`` (tokens per response, cycled),
``include_end_id``, ``fail_for(prompt_ids, params) -> message``, ``budget`` (iterations left;
None runs free) and ``allow(n)``. One engine thread runs in-flight batching iterations over
every live request (up to ``max_batch_size`` at once).
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class RequestError(RuntimeError):
    """tensorrt_llm.executor.utils.RequestError: an error the executor reported for a request."""


# ------------------------------------------------------------------ SamplingParams

@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    json_object: bool = False
    structural_tag: Optional[str] = None


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    bad: Optional[Union[str, list]] = None
    bad_token_ids: Optional[list] = None
    stop: Optional[Union[str, list]] = None
    stop_token_ids: Optional[list] = None
    include_stop_str_in_output: bool = False
    embedding_bias: Any = None
    logits_processor: Any = None
    apply_batched_logits_processor: bool = False
    n: int = 1
    best_of: Optional[int] = None
    use_beam_search: bool = False
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    top_p_min: Optional[float] = None
    top_p_reset_ids: Optional[int] = None
    top_p_decay: Optional[float] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    min_tokens: Optional[int] = None
    beam_search_diversity_rate: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    length_penalty: Optional[float] = None
    early_stopping: Optional[int] = None
    no_repeat_ngram_size: Optional[int] = None
    min_p: Optional[float] = None
    beam_width_array: Optional[list] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    additional_model_outputs: Optional[list] = None
    lookahead_config: Any = None
    guided_decoding: Optional[GuidedDecodingParams] = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self):
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        greedy = (not self.use_beam_search and (self.top_k is None or self.top_k == 1)
                  and (self.top_p is None or self.top_p == 0.0))
        if self.best_of > 1 and greedy:
            raise ValueError("Greedy decoding in the LLM API does not allow multiple returns.")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1, got "
                             f"{self.truncate_prompt_tokens}")


class KvCacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enable_block_reuse: bool = True
    max_tokens: Optional[int] = None
    max_attention_window: Optional[list] = None
    sink_token_length: Optional[int] = None
    free_gpu_memory_fraction: Optional[float] = Field(default=0.9, ge=0, le=1)
    host_cache_size: Optional[int] = None
    onboard_blocks: bool = True
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    dtype: str = "auto"
    event_buffer_max_size: int = 0


# ------------------------------------------------------------------ results

@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    _last_token_ids_len: int = 0

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def token_ids_diff(self) -> list:
        return self.token_ids[self._last_token_ids_len:]


def _has_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@dataclass
class _Response:
    tokens: list
    is_final: bool
    finish: Optional[str] = None        # END_ID / STOP_WORDS / LENGTH / CANCELLED
    error: Optional[str] = None


class RequestOutput:
    """The streaming result of one request (upstream ``GenerationResult`` + detokenization)."""

    def __init__(self, request_id: int, prompt_token_ids: list, params: SamplingParams,
                 streaming: bool, executor: "FakePyExecutor"):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = params
        self._streaming = streaming
        self._executor = executor
        self._aborted = False
        self._done = False
        self._outputs = [CompletionOutput(0)]
        if _has_event_loop():
            self._loop = asyncio.get_running_loop()
            self.aqueue: Optional[asyncio.Queue] = asyncio.Queue()
            self.queue = None
        else:
            self._loop = None
            self.aqueue = None
            self.queue = queue.Queue()

    # the executor thread delivers here
    def _put(self, response: _Response) -> None:
        if self.aqueue is not None:
            try:
                self._loop.call_soon_threadsafe(self.aqueue.put_nowait, response)
            except RuntimeError:       # the loop was closed: nobody listens any more
                pass
        else:
            self.queue.put(response)

    @property
    def outputs(self) -> list:
        return self._outputs[:self.sampling_params.n]

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self._executor.abort_request(self.request_id)
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def _handle_response(self, r: _Response) -> None:
        if r.error is not None:
            self._done = True
            raise RequestError(r.error)
        out = self._outputs[0]
        out._last_token_ids_len = len(out.token_ids)
        out.token_ids.extend(r.tokens)
        self._done = r.is_final
        if r.finish == "CANCELLED":
            out.finish_reason = "cancelled"
        if self._done:
            if r.finish == "END_ID":
                out.finish_reason = "stop"
            elif r.finish == "STOP_WORDS":
                out.finish_reason = "stop"
                stops = self.sampling_params.stop_token_ids or []
                if out.token_ids and out.token_ids[-1] in stops:
                    out.stop_reason = out.token_ids[-1]
                    if not self.sampling_params.include_stop_str_in_output:
                        out.token_ids = out.token_ids[:-1]
            elif r.finish == "LENGTH":
                out.finish_reason = "length"

    def result(self, timeout: Optional[float] = None) -> "RequestOutput":
        while not self._done:
            self._handle_response(self.queue.get(timeout=timeout))
        return self

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        self._handle_response(self.queue.get())
        return self

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        assert self.aqueue is not None, (
            "The asyncio event loop was not present during initialization, so async operations "
            "are not available.")
        self._handle_response(await self.aqueue.get())
        return self


# ------------------------------------------------------------------ the scripted engine

@dataclass
class _Live:
    result: RequestOutput
    produced: list
    finish: str
    sent: int = 0
    cancelled: bool = False
    final_sent: bool = False


class FakePyExecutor:
    """In-flight batching over every live request, on its own thread (the PyExecutor loop)."""

    script: list = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
    script_for = None
    chunks: list = [1]
    include_end_id = False
    fail_for = None

    def __init__(self, max_batch_size: int):
        self.max_batch_size = max_batch_size
        self.live: dict[int, _Live] = {}
        self.aborted: list[int] = []
        self.iterations = 0
        self.max_in_flight = 0
        self.budget: Optional[int] = None
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="fake-pyexecutor", daemon=True)
        self._thread.start()

    def _generate(self, prompt: list, p: SamplingParams) -> tuple[list, str]:
        script = self.script_for(prompt) if self.script_for else self.script
        stops = set(p.stop_token_ids or [])
        out = []
        for tok in script:
            if len(out) == p.max_tokens:
                return out, "LENGTH"
            if tok == p.end_id and not p.ignore_eos:
                if self.include_end_id:
                    out.append(tok)
                return out, "END_ID"
            out.append(tok)
            if tok in stops and not p.ignore_eos:
                return out, "STOP_WORDS"
        return out, "LENGTH" if len(out) == p.max_tokens else "END_ID"

    def submit(self, result: RequestOutput) -> None:
        import tensorrt_llm

        p = result.sampling_params
        produced, finish = self._generate(result.prompt_token_ids, p)
        with self._cv:
            self.live[result.request_id] = _Live(result, produced, finish)
            tensorrt_llm.CALLS.append(("generate_async.enqueued", {
                "id": result.request_id, "prompt_token_ids": result.prompt_token_ids,
                "sampling_params": p, "streaming": result._streaming}))
            self._cv.notify_all()

    def abort_request(self, request_id: int) -> None:
        import tensorrt_llm

        with self._cv:
            tensorrt_llm.CALLS.append(("abort_request", {"id": request_id}))
            self.aborted.append(request_id)
            if request_id in self.live:
                self.live[request_id].cancelled = True
            self._cv.notify_all()

    def allow(self, n: int) -> None:
        with self._cv:
            self.budget = (self.budget or 0) + n
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not (
                        any(not s.final_sent for s in self.live.values())
                        and (self.budget is None or self.budget > 0
                             or any(s.cancelled and not s.final_sent
                                    for s in self.live.values()))):
                    self._cv.wait(0.05)
                if self._stop:
                    return
                self._iterate()
            threading.Event().wait(0.001)      # one engine step

    def _iterate(self) -> None:
        live = [(rid, s) for rid, s in self.live.items() if not s.final_sent]
        for rid, s in live:                   # aborts are acknowledged at once
            if s.cancelled:
                s.final_sent = True
                s.result._put(_Response([], True, "CANCELLED"))
        scheduled = [(rid, s) for rid, s in live if not s.cancelled][:self.max_batch_size]
        if not scheduled or (self.budget is not None and self.budget <= 0):
            return
        if self.budget is not None:
            self.budget -= 1
        self.max_in_flight = max(self.max_in_flight, len(scheduled))
        self.iterations += 1
        for rid, s in scheduled:
            p = s.result.sampling_params
            msg = self.fail_for(s.result.prompt_token_ids, p) if self.fail_for else None
            if msg:
                s.final_sent = True
                s.result._put(_Response([], True, error=msg))
                continue
            n = self.chunks[(self.iterations - 1) % len(self.chunks)]
            new = s.produced[s.sent:s.sent + n]
            s.sent += len(new)
            s.final_sent = s.sent >= len(s.produced)
            if s.result._streaming or s.final_sent:
                s.result._put(_Response(list(new) if s.result._streaming else list(s.produced),
                                        s.final_sent, s.finish if s.final_sent else None))

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(2)


# ------------------------------------------------------------------ LLM

# TorchLlmArgs fields the fake knows (llm_args.py): a keyword outside these is refused.
TORCH_ARGS = {"max_batch_size", "max_num_tokens", "max_seq_len", "max_input_len",
              "max_beam_width", "kv_cache_config", "enable_chunked_prefill",
              "guided_decoding_backend", "cuda_graph_config", "stream_interval",
              "return_perf_metrics", "enable_attention_dp", "pipeline_parallel_size",
              "moe_expert_parallel_size", "gpus_per_node", "load_format", "speculative_config",
              "scheduler_config", "num_postprocess_workers", "postprocess_tokenizer_dir",
              "backend", "attn_backend", "sampler_type", "disable_overlap_scheduler"}
TRT_ONLY_ARGS = {"build_config", "workspace", "enable_build_cache", "extended_runtime_perf_knob_config",
                 "calib_config", "embedding_parallel_mode", "fast_build", "enable_tqdm"}
DEFAULT_MAX_BATCH_SIZE = 2048
DEFAULT_MAX_NUM_TOKENS = 8192


@dataclass
class _Args:
    model: str
    dtype: str
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: Optional[int]
    kv_cache_config: KvCacheConfig
    enable_chunked_prefill: bool
    backend: str = "pytorch"


class LLM:
    """The PyTorch-backend LLM (``tensorrt_llm.LLM`` is ``_TorchLLM`` from 1.0 on)."""

    def __init__(self, model, tokenizer=None, tokenizer_mode="auto", skip_tokenizer_init=False,
                 trust_remote_code=False, tensor_parallel_size=1, dtype="auto", revision=None,
                 tokenizer_revision=None, **kwargs):
        import tensorrt_llm

        backend = kwargs.pop("backend", "pytorch")
        trt_only = [k for k in kwargs if k in TRT_ONLY_ARGS]
        if trt_only:
            raise ValueError(
                f"The following arguments are specific to TensorRT backend and cannot be used "
                f"with PyTorch backend: {trt_only}.\nPlease use 'from tensorrt_llm._tensorrt_engine "
                f"import LLM' instead to use the TensorRT backend.")
        for key in kwargs:
            if key not in TORCH_ARGS:
                raise ValueError(f"{self.__class__.__name__} got invalid argument: {key}")
        kv = kwargs.get("kv_cache_config") or KvCacheConfig()
        if not isinstance(kv, KvCacheConfig):
            raise ValueError(f"kv_cache_config must be a KvCacheConfig, got {type(kv).__name__}")
        cfg_path = Path(str(model)) / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"Invalid model path: {model} has no config.json (the fake loads "
                             f"local Hugging Face checkpoints only)")
        hf = json.loads(cfg_path.read_text())
        self._eos = hf.get("eos_token_id")
        self.args = _Args(model=str(model), dtype=dtype,
                          max_batch_size=kwargs.get("max_batch_size") or DEFAULT_MAX_BATCH_SIZE,
                          max_num_tokens=kwargs.get("max_num_tokens") or DEFAULT_MAX_NUM_TOKENS,
                          max_seq_len=kwargs.get("max_seq_len"), kv_cache_config=kv,
                          enable_chunked_prefill=bool(kwargs.get("enable_chunked_prefill")),
                          backend=backend)
        tensorrt_llm.CALLS.append(("LLM", {"model": str(model), "tokenizer": tokenizer,
                                           "dtype": dtype, "skip_tokenizer_init":
                                           skip_tokenizer_init, **kwargs}))
        self._executor: Optional[FakePyExecutor] = FakePyExecutor(self.args.max_batch_size)
        self._next_id = 0
        self._lock = threading.Lock()

    @property
    def executor(self) -> Optional[FakePyExecutor]:
        """Test hook: the fake engine (upstream keeps it as ``_executor``)."""
        return self._executor

    def _prepare_sampling_params(self, sp: Optional[SamplingParams]) -> SamplingParams:
        if sp is None:
            sp = SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"The sampling_params must be type SamplingParams or None, but got "
                            f"{type(sp)}")
        if sp.end_id is None:
            sp.end_id = self._eos
            sp.pad_id = sp.pad_id if sp.pad_id is not None else sp.end_id
        return sp

    def generate_async(self, inputs, sampling_params=None, lora_request=None,
                       prompt_adapter_request=None, streaming=False,
                       kv_cache_retention_config=None, disaggregated_params=None,
                       _postproc_params=None, scheduling_params=None, cache_salt=None):
        if self._executor is None:
            raise RuntimeError("LLM is shutting down")
        sp = self._prepare_sampling_params(sampling_params)
        if isinstance(inputs, list) and all(isinstance(t, int) for t in inputs):
            prompt = list(inputs)
        elif isinstance(inputs, dict) and "prompt_token_ids" in inputs:
            prompt = list(inputs["prompt_token_ids"])
        else:
            raise TypeError(f"The inputs must be type str or list of int, but got "
                            f"{type(inputs)} (the fake takes token ids only)")
        a = self.args
        if not a.enable_chunked_prefill and a.max_num_tokens and len(prompt) > a.max_num_tokens:
            raise ValueError(f"The sum of prompt length ({float(len(prompt))}), query length (0) "
                             f"should not exceed max_num_tokens ({a.max_num_tokens})")
        with self._lock:
            rid = self._next_id
            self._next_id += 1
        result = RequestOutput(rid, prompt, sp, streaming, self._executor)
        self._executor.submit(result)
        return result

    def shutdown(self) -> None:
        import tensorrt_llm

        ex, self._executor = self._executor, None
        if ex is not None:
            tensorrt_llm.CALLS.append(("LLM.shutdown", {}))
            ex.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False
