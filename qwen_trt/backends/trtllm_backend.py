"""The ``trtllm`` backend: a per-GPU TensorRT-LLM engine served by the C++ executor with in-flight
batching -- several requests at once, each streamed and cancelled on its own. Without an engine
folder (and on every release after 1.3.0rc20) :func:`qwen_trt.backends.trtllm.load_trtllm` takes
the LLM API path instead, :mod:`qwen_trt.backends.trtllm_llmapi`, which reuses this module's
request handling (it imports this module; this module knows nothing of it).

Upstream calls, as read in NVIDIA/TensorRT-LLM (stored snapshots; the commit is recorded because
the search index does not map commits to tags):

* ``ModelRunnerCpp.from_dir(engine_dir, *, rank=0, max_batch_size=None, max_input_len=None,
  max_output_len=None, max_beam_width=None, kv_cache_free_gpu_memory_fraction=None,
  kv_cache_enable_block_reuse=False, enable_chunked_context=False, ...)``:
  tensorrt_llm/runtime/model_runner_cpp.py @03832911. It builds the ``ExecutorConfig`` (KV cache,
  chunked context, ...) from the engine and keeps the executor as ``runner.executor``; that is
  all this backend uses the runner for.
* Not ``ModelRunnerCpp.generate``: its streaming loop (``_stream``, same file) calls
  ``self.executor.await_responses()`` with no request id and no timeout, so two concurrent
  calls steal each other's responses (``request_ids.index`` then fails), and it reads
  ``response.result.is_final`` before ``_fill_output`` checks ``response.has_error()``, so an
  error response surfaces as the executor's generic "Cannot get the result for a response with
  an error" (cpp/tensorrt_llm/executor/responseImpl.h ``getResult``) instead of its message.
* Instead (the pattern of NVIDIA/TensorRT-LLM:examples/bindings/executor/example_advanced.py,
  whose bindings release the GIL in ``await_responses``): requests are enqueued from one thread
  (``executor.enqueue_request(Request(...))``), ONE dispatcher thread loops on
  ``executor.await_responses(timeout)`` and routes every response by ``request_id``, checking
  ``has_error()`` first and raising ``error_msg``; cancelling is ``executor.cancel_request(id)``
  (cpp/tensorrt_llm/pybind/executor/executor.cpp:108-122 @03961722; the binding releases the
  GIL while it waits). ``Request`` / ``SamplingConfig`` / ``OutputConfig`` keyword names are the
  ones ``ModelRunnerCpp.generate`` passes to ``tensorrt_llm.bindings.executor`` (same file):
  ``input_token_ids, max_tokens, streaming, sampling_config, output_config, end_id, pad_id,
  stop_words``; ``SamplingConfig(beam_width, top_k, top_p, temperature, seed)``;
  ``OutputConfig(exclude_input_from_output=True)`` (the pybind keyword of
  cpp/tensorrt_llm/pybind/executor/request.cpp). With streaming, each result's
  ``output_token_ids[0]`` holds only the new tokens.

Two ways in, one dispatcher:

* :class:`TrtllmRunner` (``backend.make_runner()``): the worker-side :class:`~qwen_trt.serving.
  runner.Runner` contract (``add`` / ``abort`` / ``step`` / ``has_work`` / ``stats``), up to
  ``max_concurrency`` = the engine's ``max_batch_size`` requests in flight;
* :meth:`TrtllmBackend.stream`: the single-request :class:`~qwen_trt.backends.base.Backend`
  contract (and the warm-up), on the same dispatcher.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from qwen_trt import settings
from qwen_trt.backends.base import Backend, BackendInfo
from qwen_trt.model.template import default_stop_ids, end_and_pad_ids
from qwen_trt.errors import first_line, BackendUnavailableError, QwenTrtError
from qwen_trt.params import SamplingParams
from qwen_trt.backends.runner import RunnerStats, TokenEvent

log = logging.getLogger(__name__)

ENGINES_DIR_ENV = "QWEN_TRT_ENGINES_DIR"
NO_END_ID = -1   # with ignore_eos: an id the model never produces, so only max_new_tokens ends it


class EngineNotFoundError(BackendUnavailableError):
    """No engine folder for this GPU."""


class TrtllmRuntimeError(QwenTrtError):
    """The TensorRT-LLM executor reported an error for a request."""


# ---------------------------------------------------------------- pure helpers

def default_engines_dir() -> Path:
    
    return Path(settings.get(ENGINES_DIR_ENV))


def runner_kwargs(manifest: dict) -> dict:
    """``ModelRunnerCpp.from_dir`` keyword arguments from the manifest's limits and runtime."""
    lim, rt = manifest["limits"], manifest["runtime"]
    return {
        "rank": 0,
        "max_batch_size": lim["max_batch_size"],
        "max_input_len": lim["max_input_len"],
        "max_beam_width": 1,
        "kv_cache_free_gpu_memory_fraction": rt["kv_cache_free_gpu_memory_fraction"],
        "kv_cache_enable_block_reuse": rt.get("kv_cache_enable_block_reuse", False),
        "enable_chunked_context": rt.get("enable_chunked_context", False),
    }


@dataclass(frozen=True)
class RequestIds:
    """end_id / pad_id / stop words for one request, from the sampling params and tokenizer."""

    end_id: int
    pad_id: int
    stop_words: tuple[int, ...]   # single-token stop words other than end_id


def request_ids_for(params: SamplingParams, im_end: int, pad_id: int,
                    default_stops: tuple[int, ...] = ()) -> RequestIds:
    """``<|im_end|>`` is the end id, and every stop id (``<|endoftext|>``...) a stop word.

    The executor takes one end id per request (``Request(end_id=...)``) and pads with it, so
    it is never None. The end id is listed as a stop word as well: NVIDIA/TensorRT-LLM#5670
    (July 2025) reports an engine that ignored end_id while stop words worked, and a stop word ends the
    request with the token in the output. With ``ignore_eos`` nothing stops the request but
    ``max_new_tokens`` (end id -1, the "no end id" value trtllm-bench uses for --eos_id).
    """
    if params.ignore_eos:
        return RequestIds(end_id=NO_END_ID, pad_id=pad_id, stop_words=())
    stops = tuple(dict.fromkeys(default_stops + tuple(params.stop_token_ids)))
    end_id = im_end if im_end in stops or not stops else stops[0]
    return RequestIds(end_id=end_id, pad_id=pad_id,
                      stop_words=(end_id,) + tuple(t for t in stops if t != end_id))


def sampling_config_kwargs(params: SamplingParams) -> dict:
    """``tensorrt_llm.bindings.executor.SamplingConfig`` keyword arguments; temperature 0 = greedy
    (top_k 1). Names as ModelRunnerCpp.generate passes them (``random_seed`` -> ``seed``; a top_p
    of 0.0 -> None, i.e. left out)."""
    if params.greedy:
        kw = {"beam_width": 1, "temperature": 1.0, "top_k": 1}
    else:
        kw = {"beam_width": 1, "temperature": float(params.temperature),
              "top_k": int(params.top_k), "top_p": float(params.top_p)}
    if params.seed is not None:
        kw["seed"] = int(params.seed)
    if params.presence_penalty:
        kw["presence_penalty"] = float(params.presence_penalty)
    if params.repetition_penalty != 1:
        kw["repetition_penalty"] = float(params.repetition_penalty)
    return kw


def final_stop_token(tokens: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int],
                     end_id: int) -> int | None:
    """The stop token to report when the executor finished early without showing it.

    The executor may end a request on end_id without putting end_id in the output. The
    Backend contract says a stop yields the stop token, so when a finished (not cancelled)
    request has fewer than ``max_new_tokens`` tokens and does not end in a stop id, it stopped
    on ``end_id``.
    """
    if end_id == NO_END_ID or len(tokens) >= max_new_tokens:
        return None
    if tokens and tokens[-1] in stop_ids:
        return None
    return end_id


@dataclass(frozen=True)
class Routed:
    """What the dispatcher hands to a request: its new tokens, or its error, and whether the
    executor is done with it."""

    tokens: tuple[int, ...] = ()
    final: bool = False
    error: str | None = None


class RequestStream:
    """One request's token ids as the Backend/Runner contracts want them.

    Clips to ``max_new_tokens``, ends at the first stop id (yielded), and when the executor
    finishes early without showing the end id, reports it (:func:`final_stop_token`).
    """

    def __init__(self, params: SamplingParams, ids: RequestIds, stop_ids) -> None:
        self.max_new = params.max_new_tokens
        self.stop_ids = set(stop_ids)            # Backend.stop_ids: none with ignore_eos
        self.end_id = ids.end_id
        self.emitted: list[int] = []
        self.finish: str | None = None
        self.error: str | None = None

    def feed(self, item: Routed) -> list[int]:
        """New token ids from ``item``; sets :attr:`finish` (and :attr:`error`) when done."""
        if self.finish is not None:
            return []
        if item.error is not None:
            self.finish = "error"
            first = (item.error.splitlines() or ["unknown error"])[0]
            self.error = f"TensorRT-LLM request failed: {first}"
            return []
        new = []
        for tok in item.tokens:
            if len(self.emitted) >= self.max_new:
                break
            self.emitted.append(tok)
            new.append(tok)
            if tok in self.stop_ids:
                self.finish = "stop"
                return new
        if len(self.emitted) >= self.max_new:
            self.finish = "length"
        elif item.final:
            tail = final_stop_token(self.emitted, self.max_new, tuple(self.stop_ids), self.end_id)
            if tail is not None:
                self.emitted.append(tail)
                new.append(tail)
            self.finish = "stop"
        return new


# ---------------------------------------------------------------- the dispatcher

class ResponseDispatcher:
    """Owns ``executor.await_responses``: one thread awaits with a timeout and routes each
    response by its request id to the sink registered at enqueue time.

    ``enqueue`` holds the routing lock while it calls ``enqueue_request`` and registers the
    sink, so a response that arrives before ``enqueue_request`` has returned is routed once the
    sink exists. Responses of requests no longer registered (finished, aborted) are dropped.
    """

    def __init__(self, executor, poll_ms: int = 20) -> None:
        self._executor = executor
        self._timeout = timedelta(milliseconds=poll_ms)
        self._lock = threading.Lock()
        self._sinks: dict[int, Callable[[Routed], None]] = {}
        self._stop = threading.Event()
        self.failure: str | None = None
        self._thread = threading.Thread(target=self._loop, name="trtllm-dispatcher", daemon=True)
        self._thread.start()

    def enqueue(self, request, sink: Callable[[Routed], None]) -> int:
        with self._lock:
            if self.failure is not None:
                raise TrtllmRuntimeError(f"TensorRT-LLM executor failed: {self.failure}")
            try:
                rid = int(self._executor.enqueue_request(request))
            except Exception as e:  # noqa: BLE001 - the executor's checks (limits, shutdown)
                first = (first_line(e) or type(e).__name__)
                raise TrtllmRuntimeError(f"TensorRT-LLM rejected the request: {first}") from e
            self._sinks[rid] = sink
            return rid

    def cancel(self, rid: int) -> None:
        """Stop the request in the executor and drop its later responses."""
        self.forget(rid)
        try:
            self._executor.cancel_request(rid)
        except Exception:  # noqa: BLE001 - finished in the meantime
            pass

    def forget(self, rid: int) -> None:
        with self._lock:
            self._sinks.pop(rid, None)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._sinks)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                responses = self._executor.await_responses(self._timeout)
            except Exception as e:  # noqa: BLE001 - executor shut down or broken
                if self._stop.is_set():
                    return
                self._fail_all((first_line(e) or type(e).__name__))
                return
            for response in responses:
                try:
                    self._route(response)
                except Exception as e:  # noqa: BLE001 - a malformed response ends its request
                    first = (first_line(e) or type(e).__name__)
                    self._deliver(getattr(response, "request_id", None),
                                  Routed(final=True, error=first))

    def _route(self, response) -> None:
        rid = response.request_id
        if response.has_error():              # before .result: it throws on an error response
            item = Routed(final=True, error=str(response.error_msg) or "unknown error")
        else:
            result = response.result
            beams = result.output_token_ids
            item = Routed(tuple(int(t) for t in (beams[0] if beams else ())),
                          bool(result.is_final))
        self._deliver(rid, item)

    def _deliver(self, rid, item: Routed) -> None:
        with self._lock:
            sink = self._sinks.get(rid)
            if item.final:
                self._sinks.pop(rid, None)
        if sink is not None:
            sink(item)
        elif item.error is not None:
            log.warning("TensorRT-LLM error for request %s (no longer routed): %s", rid,
                        item.error)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self.failure = why
            sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink(Routed(final=True, error=f"executor failed: {why}"))

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


# ---------------------------------------------------------------- engine discovery

def _manifest_fits(engine_dir: Path, gpu, versions: dict) -> bool:
    from qwen_trt.engine.manifest import manifest_problem, read_manifest

    try:
        return manifest_problem(read_manifest(engine_dir), gpu, versions) is None
    except Exception:  # noqa: BLE001 - unreadable manifest: not a candidate
        return False


def find_engine_dir(gpu, root: Path | None = None, versions: dict | None = None) -> Path | None:
    """The engine folder under ``root`` whose manifest fits ``gpu`` and ``versions``: the FP16
    one first, then BF16, then quantized ones (``--engine`` picks any)."""
    from qwen_trt.engine.env import library_versions

    root = root or default_engines_dir()
    if not root.is_dir():
        return None
    versions = versions or library_versions()
    fits = [d for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
            if (d / "rank0.engine").is_file() and _manifest_fits(d, gpu, versions)]
    return min(fits, key=_preference, default=None)


def _preference(engine_dir: Path) -> tuple:
    """Sort key of an engine folder for the auto-pick: unquantized before quantized, FP16
    before BF16, then by name."""
    try:
        m = json.loads((engine_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        m = {}
    return (bool(m.get("quantization")), m.get("dtype", "float16") != "float16", engine_dir.name)


def auto_engine_dir() -> Path | None:
    """For ``--backend auto``: this GPU's engine folder when tensorrt_llm is installed.

    Cheap and never raises: it reads package metadata instead of importing tensorrt_llm (an
    import takes seconds and starts MPI), then compares manifests under ``engines/``.
    """
    try:
        from qwen_trt.engine.env import trtllm_available
        from qwen_trt.engine.gpu import detect_gpu

        if not trtllm_available():
            return None
        gpu = detect_gpu()
        if gpu is None:
            return None
        return find_engine_dir(gpu)
    except Exception:  # noqa: BLE001 - auto selection must fall back to torch, never fail
        return None


# ---------------------------------------------------------------- the worker-side runner

class TrtllmRunner:
    """The :class:`~qwen_trt.backends.runner.Runner` contract over the executor's in-flight
    batching. Thread-confined like the contract says (one worker thread calls every method);
    the dispatcher thread only fills the ready queue.

    ``step()`` waits up to ``wait_s`` for the first ready response, then drains every ready one
    and returns one :class:`TokenEvent` per request that has news.
    """

    def __init__(self, backend: "TrtllmBackend", wait_s: float = 0.02) -> None:
        self._backend = backend
        self.max_concurrency = backend.info.max_concurrency
        self.wait_s = wait_s
        self._ready: queue.Queue[tuple[int, Routed]] = queue.Queue()
        self._active: dict[int, tuple[int, RequestStream]] = {}   # our id -> (executor id, state)
        self._done: list[TokenEvent] = []                           # events not tied to a response
        self._prompt_tokens = 0

    def add(self, request_id: int, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if request_id in self._active:
            raise ValueError(f"request {request_id} is already running")
        try:
            self._backend.check_request(prompt_ids, params)   # the runner's admission check
            state, request = self._backend._prepare(prompt_ids, params)
            rid = self._backend._dispatcher.enqueue(
                request, lambda item, r=request_id: self._ready.put((r, item)))
        except QwenTrtError as e:
            self._done.append(TokenEvent(request_id, finish="error", error=str(e)))
            return
        self._active[request_id] = (rid, state)
        self._prompt_tokens += len(prompt_ids)

    def abort(self, request_id: int) -> None:
        entry = self._active.pop(request_id, None)
        if entry is None:
            return
        self._backend._dispatcher.cancel(entry[0])
        self._done.append(TokenEvent(request_id, finish="cancelled"))

    def has_work(self) -> bool:
        return bool(self._active or self._done or not self._ready.empty())

    def step(self) -> list[TokenEvent]:
        items: list[tuple[int, Routed]] = []
        if not self._done and self._active:
            try:
                items.append(self._ready.get(timeout=self.wait_s))
            except queue.Empty:
                pass
        while True:
            try:
                items.append(self._ready.get_nowait())
            except queue.Empty:
                break
        events, self._done = self._done, []
        news: dict[int, list[int]] = {}
        for request_id, item in items:
            entry = self._active.get(request_id)
            if entry is None:
                continue      # aborted: its late responses are dropped
            state = entry[1]
            news.setdefault(request_id, []).extend(state.feed(item))
        for request_id, tokens in news.items():
            rid, state = self._active[request_id]
            if state.finish is not None:
                del self._active[request_id]
                self._backend._dispatcher.forget(rid)
            if tokens or state.finish is not None:
                events.append(TokenEvent(request_id, tuple(tokens), finish=state.finish,
                                         error=state.error))
        return events

    def stats(self) -> RunnerStats:
        """Requests beyond ``max_concurrency`` wait inside the executor's queue."""
        n = len(self._active)
        return RunnerStats(running=min(n, self.max_concurrency),
                           waiting=max(0, n - self.max_concurrency),
                           prompt_tokens=self._prompt_tokens,
                           extra={"backend": "trtllm", "path": self._backend.info.path,
                                  "executor_in_flight": self._backend._dispatcher.in_flight})


# ---------------------------------------------------------------- backend

class TrtllmBackend(Backend):
    """A TensorRT-LLM engine behind one :class:`ResponseDispatcher`."""

    name = "trtllm"
    stall_timeout_s = 300.0   # a request that hears nothing from the executor this long fails

    def __init__(self, runner, tokenizer, manifest: dict, engine_dir: Path, gpu_name: str,
                 poll_ms: int = 20) -> None:
        super().__init__()
        self.runner = runner
        self._tokenizer = tokenizer
        self.manifest = manifest
        self.engine_dir = engine_dir
        tok = manifest.get("tokenizer") or {}
        end_id, pad_id = end_and_pad_ids(tokenizer)   # what the build recorded, if it did
        self._im_end = int(tok.get("end_id", end_id))
        self._pad_id = int(tok.get("pad_id", pad_id))
        lim = manifest["limits"]
        dtype = manifest.get("dtype") or manifest.get("build_flags", {}).get("dtype", "float16")
        self._info = BackendInfo(name=self.name, model=str(engine_dir), device=gpu_name,
                                 dtype=dtype, max_input_len=int(lim["max_input_len"]),
                                 max_seq_len=int(lim["max_seq_len"]),
                                 stop_token_ids=default_stop_ids(tokenizer),
                                 max_concurrency=int(lim["max_batch_size"]), path="engine")
        self._dispatcher = ResponseDispatcher(runner.executor, poll_ms)
        self._active_id: int | None = None

    @staticmethod
    def find_engine(gpu, versions: dict, load_all) -> Path | None:
        """This GPU's engine folder under engines/ (the FP16 one first), or the folder built for
        this GPU with other libraries (so loading says what to rebuild), or None."""
        from qwen_trt.engine.gpu import suggest_profile

        engine_dir = find_engine_dir(gpu, versions=versions)
        if engine_dir is not None:
            return engine_dir
        try:
            suggestion = suggest_profile(gpu, load_all())
        except QwenTrtError:
            suggestion = None
        stale = default_engines_dir() / suggestion if suggestion else None
        if stale is not None and (stale / "manifest.json").is_file():
            return stale
        return None

    @classmethod
    def load_engine(cls, engine_dir: Path, model: str | None, gpu, *,
                     warmup: bool = True) -> "TrtllmBackend":
        from qwen_trt.engine.profiles import load_all
        from qwen_trt.engine.env import library_versions
        from qwen_trt.engine.manifest import check_manifest, read_manifest
        from qwen_trt.engine.gpu import suggest_profile

        versions = library_versions()
        try:
            suggestion = suggest_profile(gpu, load_all())
        except QwenTrtError:
            suggestion = None
        if not (engine_dir / "rank0.engine").is_file():
            raise EngineNotFoundError(
                f"{engine_dir} has no rank0.engine: build it with "
                f"`make engine GPU={suggestion or '<gpu>'}`.")
        manifest = read_manifest(engine_dir)
        check_manifest(engine_dir, manifest, gpu, versions, suggestion)
        tokenizer = _load_tokenizer(engine_dir, model)

        from tensorrt_llm.runtime import ModelRunnerCpp

        try:
            runner = ModelRunnerCpp.from_dir(str(engine_dir), **runner_kwargs(manifest))
        except Exception as e:  # TensorRT deserialization, MPI, out of memory
            first = (first_line(e) or type(e).__name__)
            raise BackendUnavailableError(
                f"TensorRT-LLM could not load {engine_dir} ({type(e).__name__}: {first}); if the "
                f"driver or libraries changed, rebuild with `qwen-trt build --force --gpu "
                f"{suggestion or manifest['profile'].get('name', '<gpu>')}`.") from e
        backend = cls(runner, tokenizer, manifest, engine_dir, gpu.name)
        if warmup:
            backend.warmup()
        return backend

    def make_runner(self, wait_s: float = 0.02) -> TrtllmRunner:
        """The worker-side runner over this engine (in-flight batching)."""
        return TrtllmRunner(self, wait_s)

    def _prepare(self, prompt_ids: Sequence[int], params: SamplingParams):
        """``(RequestStream, tensorrt_llm.bindings.executor.Request)`` for one request."""
        import tensorrt_llm.bindings.executor as trtllm

        ids = request_ids_for(params, self._im_end, self._pad_id, self._info.stop_token_ids)
        request = trtllm.Request(
            input_token_ids=[int(t) for t in prompt_ids], max_tokens=params.max_new_tokens,
            streaming=True, sampling_config=trtllm.SamplingConfig(**sampling_config_kwargs(params)),
            output_config=trtllm.OutputConfig(exclude_input_from_output=True),
            end_id=ids.end_id, pad_id=ids.pad_id,
            stop_words=[[t] for t in ids.stop_words] if ids.stop_words else None)
        return RequestStream(params, ids, self.stop_ids(params)), request

    def cancel(self) -> None:
        """Thread-safe: stop the request :meth:`stream` is running now."""
        super().cancel()
        rid = self._active_id
        if rid is not None:
            self._dispatcher.cancel(rid)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        cancel = self._begin()
        state, request = self._prepare(prompt_ids, params)
        inbox: queue.Queue[Routed] = queue.Queue()
        rid = self._dispatcher.enqueue(request, inbox.put)
        self._active_id = rid
        done = False
        try:
            last = time.monotonic()
            while not cancel.is_set():
                try:
                    item = inbox.get(timeout=0.05)
                except queue.Empty:
                    if time.monotonic() - last > self.stall_timeout_s:
                        raise TrtllmRuntimeError(
                            f"TensorRT-LLM sent nothing for {self.stall_timeout_s:.0f} s; the "
                            f"request was cancelled.") from None
                    continue
                last = time.monotonic()
                new = state.feed(item)
                # stop / length / error: the executor ends the request by itself, so a caller
                # that closes the stream right after the stop token does not cancel it
                done = state.finish is not None
                for tok in new:
                    if cancel.is_set():
                        break
                    yield tok
                if state.finish == "error":
                    raise TrtllmRuntimeError(state.error)
                if done:
                    return
        finally:
            self._active_id = None
            if done or cancel.is_set():        # finished, or cancel() already stopped it
                self._dispatcher.forget(rid)
            else:                              # closed early: stop it now
                self._dispatcher.cancel(rid)

    def close(self) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            self._dispatcher.close(timeout=0)
            try:
                runner.executor.shutdown()
            except Exception:  # noqa: BLE001
                pass
            self._dispatcher.close()


def _load_tokenizer(engine_dir: Path, model: str | None):
    """The tokenizer copied into the engine folder at build time, else from ``model``."""
    from qwen_trt.engine.manifest import TOKENIZER_DIR
    from qwen_trt.model.source import load_tokenizer, resolve_model

    tok_dir = engine_dir / TOKENIZER_DIR
    if (tok_dir / "tokenizer.json").is_file() or (tok_dir / "vocab.json").is_file():
        return load_tokenizer(tok_dir)
    if model:
        source = resolve_model(model)
        return load_tokenizer(source.path, source.name)
    raise EngineNotFoundError(f"{engine_dir} has no {TOKENIZER_DIR}/ folder: pass --model with the "
                              f"checkpoint it was built from, or rebuild the engine.")
