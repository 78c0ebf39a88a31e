"""The ``trtllm`` backend's LLM API path: the Hugging Face checkpoint served by TensorRT-LLM's
PyTorch backend (``tensorrt_llm.LLM``), no engine build.

This is the path of every TensorRT-LLM release after 1.3.0rc20 (the TensorRT engine backend is
gone there) and of 1.2.x when no engine folder is given or found. Upstream calls, as read in
NVIDIA/TensorRT-LLM (stored snapshots; the commit each was read at):

* ``LLM(model, tokenizer=None, ..., dtype='auto', **kwargs)`` with the args ``max_batch_size``,
  ``max_num_tokens``, ``max_seq_len``, ``enable_chunked_prefill`` and
  ``kv_cache_config=KvCacheConfig(enable_block_reuse=True, free_gpu_memory_fraction=...)``:
  tensorrt_llm/llmapi/llm.py @4c05a748 (``_TorchLLM``), tensorrt_llm/llmapi/llm_args.py
  (``KvCacheConfig``, ``TorchLlmArgs``).
* ``llm.generate_async(prompt_token_ids, sampling_params, streaming=True)`` per request: the
  executor batches every request in flight (in-flight batching); the result is an async
  iterator of ``RequestOutput`` whose ``outputs[0].token_ids_diff`` holds the new tokens and
  ``finished`` says the last one came; ``result.abort()`` cancels it
  (tensorrt_llm/executor/result.py @005bc848). The result's queue is an asyncio one only when
  ``generate_async`` runs with an event loop running, so every call happens on one asyncio
  loop in a thread of its own (as trtllm-serve does), and the worker's thread hands requests
  over to it.
* ``SamplingParams`` (tensorrt_llm/sampling_params.py @000a01de), mapped from ours by
  :func:`llmapi_sampling_kwargs`.

:class:`LlmApiBackend` reuses the engine path's request bookkeeping (``RequestStream``, the
``TrtllmRunner`` worker-side runner, ``stream``/``cancel``) over :class:`LlmApiDispatcher`, which
has the engine dispatcher's interface (``enqueue`` / ``cancel`` / ``forget`` / ``in_flight`` /
``close``).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from qwen_trt.backends.base import BackendInfo
from qwen_trt.backends.trtllm_backend import (NO_END_ID, RequestStream, Routed, TrtllmBackend,
                                              TrtllmRuntimeError, request_ids_for)
from qwen_trt.model.template import default_stop_ids, end_and_pad_ids
from qwen_trt.errors import BackendUnavailableError, QwenTrtError
from qwen_trt.params import SamplingParams

log = logging.getLogger(__name__)

PATH = "llmapi"
SUBMIT_TIMEOUT_S = 60.0     # generate_async returns at once; this only bounds a wedged loop


def first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0] or type(e).__name__


@dataclass(frozen=True)
class LlmApiLimits:
    """What the LLM is started with (from this GPU's build profile, or the defaults)."""

    max_batch_size: int
    max_seq_len: int
    max_num_tokens: int
    kv_cache_free_gpu_memory_fraction: float
    enable_chunked_prefill: bool = True
    profile: str | None = None

    @property
    def max_input_len(self) -> int:
        return self.max_seq_len - 1


# A GPU with no matching profile: one chat of 16k context at a time, KV from 85 % of the memory
# left after the weights (the A10 profile's fraction).
DEFAULT_LIMITS = LlmApiLimits(max_batch_size=8, max_seq_len=16384, max_num_tokens=8192,
                              kv_cache_free_gpu_memory_fraction=0.85)


def limits_for(gpu, max_seq_len: int | None = None) -> LlmApiLimits:
    """The limits of the build profile that fits ``gpu`` (build/profiles/<gpu>.toml: the same
    sizing as its engine), else :data:`DEFAULT_LIMITS`; ``max_seq_len`` (``--max-seq-len``)
    overrides the context length."""
    from qwen_trt.engine.gpu import matching_profiles
    from qwen_trt.engine.profiles import load_all

    try:
        fits = matching_profiles(gpu, load_all()) if gpu is not None else []
    except QwenTrtError:
        fits = []
    if fits:
        p = fits[0]
        lim = LlmApiLimits(max_batch_size=p.build.max_batch_size, max_seq_len=p.build.max_seq_len,
                           max_num_tokens=p.build.max_num_tokens,
                           kv_cache_free_gpu_memory_fraction=p.runtime.kv_cache_free_gpu_memory_fraction,
                           enable_chunked_prefill=p.runtime.enable_chunked_context,
                           profile=p.name)
    else:
        lim = DEFAULT_LIMITS
    if max_seq_len is not None:
        lim = LlmApiLimits(lim.max_batch_size, max_seq_len, min(lim.max_num_tokens, max_seq_len),
                           lim.kv_cache_free_gpu_memory_fraction, lim.enable_chunked_prefill,
                           lim.profile)
    return lim


FP8_MIN_CC = (8, 9)


def checkpoint_precision(config: dict) -> str:
    """What the checkpoint's weights are, for BackendInfo.dtype: its ``quantization_config``
    (``"fp8 (128x128 blocks)"`` for Qwen's FP8 release, whose ``weight_block_size`` is
    [128, 128]) or its dtype."""
    q = config.get("quantization_config") or {}
    if isinstance(q, dict) and q.get("quant_method"):
        blocks = q.get("weight_block_size")
        shape = f" ({'x'.join(str(b) for b in blocks)} blocks)" if blocks else ""
        return f"{q['quant_method']}{shape}"
    return str(config.get("torch_dtype") or config.get("dtype") or "auto")


def check_checkpoint_gpu(name: str, config: dict, gpu) -> None:
    """One line when ``gpu`` cannot run the checkpoint's quantization: an FP8 checkpoint needs
    FP8 tensor cores (sm89+). Upstream documents FP8 on the PyTorch backend for Hopper and
    Blackwell (docs: features/quantization, "The default PyTorch backend supports FP4 and FP8
    quantization on the latest Blackwell and Hopper GPUs"), so on sm89 it is logged as untested."""
    q = config.get("quantization_config") or {}
    if not (isinstance(q, dict) and str(q.get("quant_method", "")).lower() == "fp8"):
        return
    cc = tuple(gpu.compute_capability)
    if cc < FP8_MIN_CC:
        raise BackendUnavailableError(
            f"{name} is an FP8 checkpoint ({checkpoint_precision(config)}), which needs an sm89+ "
            f"GPU (L4, RTX 4090, H100, H200); this GPU is {gpu.short_name} ({gpu.sm}): serve the "
            f"BF16 checkpoint (Qwen/Qwen3-4B-Instruct-2507) or build an INT4 engine (`make engine "
            f"QUANT=int4_awq`).")
    if cc < (9, 0):
        log.warning("%s: FP8 on %s (%s) is not among the GPUs TensorRT-LLM documents for FP8 on "
                    "its PyTorch backend (Hopper, Blackwell)", name, gpu.short_name, gpu.sm)


def llm_kwargs(limits: LlmApiLimits, kv_cache_config) -> dict:
    """Keyword arguments of ``tensorrt_llm.LLM`` besides the model (TorchLlmArgs field names)."""
    return {"max_batch_size": limits.max_batch_size, "max_seq_len": limits.max_seq_len,
            "max_num_tokens": limits.max_num_tokens,
            "enable_chunked_prefill": limits.enable_chunked_prefill,
            "kv_cache_config": kv_cache_config}


def llmapi_sampling_kwargs(params: SamplingParams, end_id: int,
                           stop_words: tuple[int, ...]) -> dict:
    """``tensorrt_llm.SamplingParams`` keyword arguments for ``params``.

    One to one: max_new_tokens -> max_tokens, temperature, top_p, seed, presence_penalty,
    repetition_penalty, ignore_eos, the stop ids -> stop_token_ids (with ``<|im_end|>`` as end_id).
    Not one to one: temperature 0 (greedy) -> top_k 1 (upstream's greedy is top_k None/1 with
    top_p None); top_k 0 (no top-k filter) -> None (upstream: None = all logits). Added: the stop
    token stays in the output (``include_stop_str_in_output``, so a stop is seen as its token)
    and ``detokenize=False`` (qwen-trt detokenizes itself, so streamed text equals the final
    decode).
    """
    kw: dict = {"max_tokens": params.max_new_tokens, "end_id": end_id, "detokenize": False,
                "include_stop_str_in_output": True}
    if params.greedy:
        kw["top_k"] = 1
    else:
        kw["temperature"] = float(params.temperature)
        kw["top_p"] = float(params.top_p)
        kw["top_k"] = int(params.top_k) or None
    if params.seed is not None:
        kw["seed"] = int(params.seed)
    if params.presence_penalty:
        kw["presence_penalty"] = float(params.presence_penalty)
    if params.repetition_penalty != 1:
        kw["repetition_penalty"] = float(params.repetition_penalty)
    if params.ignore_eos:
        kw["ignore_eos"] = True
    elif stop_words:
        kw["stop_token_ids"] = list(stop_words)
    return kw


class _Handle:
    """One request on the loop: its upstream result (set once submitted) and whether it was
    cancelled before that."""

    __slots__ = ("result", "cancelled")

    def __init__(self) -> None:
        self.result = None
        self.cancelled = False


class LlmApiDispatcher:
    """Runs every ``generate_async`` and every result iteration on one asyncio loop thread and
    routes each result's news to the sink registered at enqueue time."""

    def __init__(self, llm) -> None:
        self._llm = llm
        self._lock = threading.Lock()
        self._sinks: dict[int, Callable[[Routed], None]] = {}
        self._handles: dict[int, _Handle] = {}
        self._next = 1
        self.failure: str | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="trtllm-llmapi", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def enqueue(self, request, sink: Callable[[Routed], None]) -> int:
        """Submit ``request`` = (prompt ids, tensorrt_llm.SamplingParams); returns our id.
        A request the LLM refuses (its argument checks, a shut-down executor) raises here."""
        prompt_ids, sp = request
        with self._lock:
            if self.failure is not None:
                raise TrtllmRuntimeError(f"TensorRT-LLM executor failed: {self.failure}")
            rid, self._next = self._next, self._next + 1
            handle = _Handle()
            self._sinks[rid], self._handles[rid] = sink, handle
        future = asyncio.run_coroutine_threadsafe(self._submit(rid, prompt_ids, sp, handle),
                                                  self._loop)
        try:
            future.result(SUBMIT_TIMEOUT_S)
        except FutureTimeout:
            self.forget(rid)
            raise TrtllmRuntimeError("TensorRT-LLM did not take the request within "
                                     f"{SUBMIT_TIMEOUT_S:.0f} s.") from None
        except Exception as e:  # noqa: BLE001 - the LLM's own checks (ValueError, RuntimeError)
            self.forget(rid)
            raise TrtllmRuntimeError(f"TensorRT-LLM rejected the request: {first_line(e)}") from e
        return rid

    async def _submit(self, rid: int, prompt_ids, sp, handle: _Handle) -> None:
        result = self._llm.generate_async(list(prompt_ids), sampling_params=sp, streaming=True)
        handle.result = result
        if handle.cancelled:
            result.abort()
        self._loop.create_task(self._consume(rid, result))

    async def _consume(self, rid: int, result) -> None:
        try:
            async for out in result:
                comp = out.outputs[0]
                self._deliver(rid, Routed(tuple(int(t) for t in comp.token_ids_diff),
                                          bool(out.finished)))
        except Exception as e:  # noqa: BLE001 - RequestError from the executor, or a broken one
            self._deliver(rid, Routed(final=True, error=first_line(e)))
        else:
            self._deliver(rid, Routed(final=True))   # in case the last output was not final

    def _deliver(self, rid: int, item: Routed) -> None:
        with self._lock:
            sink = self._sinks.get(rid)
            if item.final:
                self._sinks.pop(rid, None)
                self._handles.pop(rid, None)
        if sink is not None:
            sink(item)
        elif item.error is not None:
            log.warning("TensorRT-LLM error for request %s (no longer routed): %s", rid,
                        item.error)

    def cancel(self, rid: int) -> None:
        """Abort the request in the executor and drop its later news."""
        with self._lock:
            self._sinks.pop(rid, None)
            handle = self._handles.pop(rid, None)
        if handle is None:
            return

        def abort() -> None:
            handle.cancelled = True
            if handle.result is not None:
                try:
                    handle.result.abort()
                except Exception:  # noqa: BLE001 - finished in the meantime
                    pass

        try:
            self._loop.call_soon_threadsafe(abort)
        except RuntimeError:      # the loop is closed: nothing runs any more
            pass

    def forget(self, rid: int) -> None:
        with self._lock:
            self._sinks.pop(rid, None)
            self._handles.pop(rid, None)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._sinks)

    def close(self, timeout: float = 2.0) -> None:
        """Cancel the result iterations still running, then stop and close the loop."""
        if self._loop.is_closed():
            return

        async def stop() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop)
        except RuntimeError:
            return
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()


class LlmApiBackend(TrtllmBackend):
    """The checkpoint through ``tensorrt_llm.LLM`` (PyTorch backend), with the engine path's
    request handling (:class:`TrtllmBackend`: ``stream``, ``cancel``, ``make_runner``)."""

    def __init__(self, llm, tokenizer, model_name: str, gpu_name: str, limits: LlmApiLimits,
                 sampling_cls, version: str, precision: str = "auto") -> None:
        # Backend.__init__ only: TrtllmBackend.__init__ sets up an engine's runner and manifest
        super(TrtllmBackend, self).__init__()
        self.llm = llm
        self.runner = None
        self.manifest = None
        self.engine_dir = None
        self.limits = limits
        self.version = version
        self._sampling_cls = sampling_cls
        self._tokenizer = tokenizer
        self._im_end, self._pad_id = end_and_pad_ids(tokenizer)
        self._info = BackendInfo(name=self.name, model=model_name, device=gpu_name,
                                 dtype=precision, max_input_len=limits.max_input_len,
                                 max_seq_len=limits.max_seq_len,
                                 stop_token_ids=default_stop_ids(tokenizer),
                                 max_concurrency=limits.max_batch_size, path=PATH)
        self._dispatcher = LlmApiDispatcher(llm)
        self._active_id = None

    @classmethod
    def load_checkpoint(cls, model: str | None = None, *, gpu=None, max_seq_len: int | None = None,
                        warmup: bool = True) -> "LlmApiBackend":
        from qwen_trt.engine.env import require_trtllm
        from qwen_trt.engine.gpu import require_gpu
        from qwen_trt.model.source import load_tokenizer, resolve_model

        trtllm = require_trtllm("llmapi")
        gpu = gpu or require_gpu()
        source = resolve_model(model)
        check_checkpoint_gpu(source.name, source.config, gpu)
        tokenizer = load_tokenizer(source.path, source.name)
        limits = limits_for(gpu, max_seq_len)
        from tensorrt_llm import LLM, SamplingParams as TrtSamplingParams
        from tensorrt_llm.llmapi import KvCacheConfig

        kv = KvCacheConfig(enable_block_reuse=True,
                           free_gpu_memory_fraction=limits.kv_cache_free_gpu_memory_fraction)
        try:
            llm = LLM(model=str(source.path), **llm_kwargs(limits, kv))
        except Exception as e:  # noqa: BLE001 - bad checkpoint, out of memory, MPI...
            raise BackendUnavailableError(
                f"TensorRT-LLM could not load {source.name} through the LLM API "
                f"({type(e).__name__}: {first_line(e)}).") from e
        version = str(getattr(trtllm, "__version__", "unknown"))
        backend = cls(llm, tokenizer, source.name, gpu.name, limits, TrtSamplingParams, version,
                      checkpoint_precision(source.config))
        log.info("trtllm: LLM API path (PyTorch backend, tensorrt_llm %s) on %s, limits of %s",
                 version, source.name, limits.profile or "the defaults")
        if warmup:
            backend.warmup()
        return backend

    def _prepare(self, prompt_ids: Sequence[int], params: SamplingParams):
        """``(RequestStream, (prompt ids, tensorrt_llm.SamplingParams))`` for one request."""
        ids = request_ids_for(params, self._im_end, self._pad_id, self._info.stop_token_ids)
        end_id = self._im_end if ids.end_id == NO_END_ID else ids.end_id   # ignore_eos: unused
        sp = self._sampling_cls(**llmapi_sampling_kwargs(params, end_id, ids.stop_words))
        return RequestStream(params, ids, self.stop_ids(params)), ([int(t) for t in prompt_ids], sp)

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.shutdown()
            except Exception:  # noqa: BLE001
                pass
            self._dispatcher.close()
