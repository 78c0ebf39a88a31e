"""The ``trtllm`` backend: a per-GPU FP16 TensorRT-LLM engine run by ``ModelRunnerCpp``.

Upstream calls, as read in NVIDIA/TensorRT-LLM (stored snapshots; commit recorded because the
search index does not map commits to tags):

* ``ModelRunnerCpp.from_dir(engine_dir, *, rank=0, max_batch_size=None, max_input_len=None,
  max_output_len=None, max_beam_width=None, kv_cache_free_gpu_memory_fraction=None,
  kv_cache_enable_block_reuse=False, enable_chunked_context=False, ...)``:
  tensorrt_llm/runtime/model_runner_cpp.py @03832911. Runtime limits must not exceed the
  engine's; leaving ``max_output_len`` None makes the runtime max_seq_len the engine's.
* ``ModelRunnerCpp.generate(batch_input_ids: List[Tensor], *, streaming, max_new_tokens, end_id,
  pad_id, stop_words_list, return_dict, output_sequence_lengths, **sampling kwargs)``, same
  file: it enqueues the requests with ``self.executor.enqueue_requests`` at call time and, when
  streaming, returns a generator (``_stream``) that loops on ``executor.await_responses()`` until
  every request is final. Each item is ``{'output_ids': int32 [batch, beams, max_seq_len],
  'sequence_lengths': int32 [batch, beams]}``: prompt-prefixed, cumulative, padded with end_id,
  lengths include the prompt. Sampling kwargs ``top_k``, ``top_p`` (0.0 -> None),
  ``temperature``, ``random_seed`` (renamed to ``seed``) become ``trtllm.SamplingConfig``.
  ``stop_words_list`` is per request: ``[[ [tok, ...], ... ]]``.
* Cancelling: the generate() generator exposes no request id and closing it does not stop the
  executor; a response of the old request arriving during the next call would make
  ``_fill_output`` fail (``request_ids.index``). So :class:`_RequestIdRecorder` wraps
  ``runner.executor`` to learn the ids ``enqueue_requests`` returns, cancellation calls
  ``executor.cancel_request(id)`` (pybind ``Executor.cancel_request(id)``,
  cpp/tensorrt_llm/pybind/executor/executor.cpp @03961722), and the generator is then drained
  until the executor's final response for that id, so the runner is clean for the next request.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from qwen_trt.backends.base import Backend, BackendInfo
from qwen_trt.chat.template import default_stop_ids, end_and_pad_ids
from qwen_trt.errors import BackendUnavailableError, QwenTrtError
from qwen_trt.params import SamplingParams

ENGINES_DIR_ENV = "QWEN_TRT_ENGINES_DIR"
NO_END_ID = -1   # with ignore_eos: an id the model never produces, so only max_new_tokens ends it


class EngineNotFoundError(BackendUnavailableError):
    """No engine folder for this GPU."""


class TrtllmRuntimeError(QwenTrtError):
    """The TensorRT-LLM executor reported an error for a request."""


# ---------------------------------------------------------------- pure helpers

def default_engines_dir() -> Path:
    import os

    return Path(os.environ.get(ENGINES_DIR_ENV, "engines"))


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

    ``ModelRunnerCpp`` takes one end id per request and pads outputs with it, so it is never
    None. The end id is listed as a stop word as well: NVIDIA/TensorRT-LLM#5670 (July 2025)
    reports an engine that ignored end_id while stop words worked, and a stop word ends the
    request with the token in the output. With ``ignore_eos`` nothing stops the request but
    ``max_new_tokens`` (end id -1, the "no end id" value trtllm-bench uses for --eos_id).
    """
    if params.ignore_eos:
        return RequestIds(end_id=NO_END_ID, pad_id=pad_id, stop_words=())
    stops = tuple(dict.fromkeys(default_stops + tuple(params.stop_token_ids)))
    end_id = im_end if im_end in stops or not stops else stops[0]
    return RequestIds(end_id=end_id, pad_id=pad_id,
                      stop_words=(end_id,) + tuple(t for t in stops if t != end_id))


def sampling_kwargs(params: SamplingParams) -> dict:
    """Sampling keyword arguments for ``ModelRunnerCpp.generate``; temperature 0 = greedy."""
    if params.greedy:
        kw = {"temperature": 1.0, "top_k": 1, "top_p": 0.0}
    else:
        kw = {"temperature": float(params.temperature), "top_k": int(params.top_k),
              "top_p": float(params.top_p)}
    if params.seed is not None:
        kw["random_seed"] = int(params.seed)
    if params.presence_penalty:
        kw["presence_penalty"] = float(params.presence_penalty)
    if params.repetition_penalty != 1:
        kw["repetition_penalty"] = float(params.repetition_penalty)
    return kw


def _to_list(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def _scalar(x) -> int:
    return int(x.item()) if hasattr(x, "item") else int(x)


class OutputDeltas:
    """Turns ModelRunnerCpp's cumulative streaming outputs into new token ids.

    Each streamed item holds, for batch 0 / beam 0, ``output_ids[0][0]`` = prompt + every token
    generated so far + end_id padding up to max_seq_len, and ``sequence_lengths[0][0]`` = prompt
    length + generated count. One item may bring several new tokens (responses pile up while the
    caller is busy); an item may also bring none.
    """

    def __init__(self, prompt_len: int, max_new_tokens: int) -> None:
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        self.emitted = 0

    def update(self, output: dict) -> list[int]:
        seq_len = _scalar(output["sequence_lengths"][0][0])
        total = min(seq_len - self.prompt_len, self.max_new_tokens)
        if total <= self.emitted:
            return []
        start, stop = self.prompt_len + self.emitted, self.prompt_len + total
        row = output["output_ids"][0][0]
        new = [int(t) for t in _to_list(row[start:stop])]   # only the new slice leaves the GPU
        self.emitted = total
        return new


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


class _RequestIdRecorder:
    """Stands in for ``runner.executor``: forwards everything, remembers enqueued ids.

    It also drops responses of requests other than the current one (a cancelled request whose
    final response arrives late would otherwise make the runner's ``request_ids.index`` fail
    in the next call), and can put a timeout on ``await_responses`` while draining.
    """

    def __init__(self, executor) -> None:
        self._executor = executor
        self.last_ids: list[int] = []
        self.timeout_ms: int | None = None

    def enqueue_requests(self, requests):
        ids = self._executor.enqueue_requests(requests)
        self.last_ids = list(ids)
        return ids

    def await_responses(self, *args, **kwargs):
        if self.timeout_ms is not None and not args and "timeout" not in kwargs:
            from datetime import timedelta

            kwargs["timeout"] = timedelta(milliseconds=self.timeout_ms)
        responses = self._executor.await_responses(*args, **kwargs)
        live = set(self.last_ids)
        return [r for r in responses if r.request_id in live]

    def __getattr__(self, name):
        return getattr(self._executor, name)


# ---------------------------------------------------------------- engine discovery

def _manifest_fits(engine_dir: Path, gpu, versions: dict) -> bool:
    from qwen_trt.engine.manifest import manifest_problem, read_manifest

    try:
        return manifest_problem(read_manifest(engine_dir), gpu, versions) is None
    except Exception:  # noqa: BLE001 - unreadable manifest: not a candidate
        return False


def find_engine_dir(gpu, root: Path | None = None, versions: dict | None = None) -> Path | None:
    """The engine folder under ``root`` whose manifest fits ``gpu`` and ``versions``."""
    from qwen_trt.engine.env import library_versions

    root = root or default_engines_dir()
    if not root.is_dir():
        return None
    versions = versions or library_versions()
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if (d / "rank0.engine").is_file() and _manifest_fits(d, gpu, versions):
            return d
    return None


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


# ---------------------------------------------------------------- backend

class TrtllmBackend(Backend):
    """Streams tokens from a TensorRT-LLM engine through ``ModelRunnerCpp``."""

    name = "trtllm"
    drain_timeout_s = 5.0   # how long a cancelled request may take to send its final response

    def __init__(self, runner, tokenizer, manifest: dict, engine_dir: Path, gpu_name: str) -> None:
        super().__init__()
        self._recorder = _RequestIdRecorder(runner.executor)
        runner.executor = self._recorder
        self.runner = runner
        self._tokenizer = tokenizer
        self.manifest = manifest
        self.engine_dir = engine_dir
        tok = manifest.get("tokenizer") or {}
        end_id, pad_id = end_and_pad_ids(tokenizer)   # what the build recorded, if it did
        self._im_end = int(tok.get("end_id", end_id))
        self._pad_id = int(tok.get("pad_id", pad_id))
        lim = manifest["limits"]
        self._info = BackendInfo(name=self.name, model=str(engine_dir), device=gpu_name,
                                 dtype=manifest.get("build_flags", {}).get("dtype", "float16"),
                                 max_input_len=int(lim["max_input_len"]),
                                 max_seq_len=int(lim["max_seq_len"]),
                                 stop_token_ids=default_stop_ids(tokenizer))
        self._active_id: int | None = None

    @classmethod
    def load(cls, engine: str | None = None, model: str | None = None, *,
             warmup: bool = True) -> "TrtllmBackend":
        from qwen_trt.engine.profiles import load_all
        from qwen_trt.engine.env import library_versions, require_trtllm
        from qwen_trt.engine.manifest import check_manifest, read_manifest
        from qwen_trt.engine.gpu import require_gpu, suggest_profile

        require_trtllm()
        gpu = require_gpu()
        versions = library_versions()
        try:
            suggestion = suggest_profile(gpu, load_all())
        except QwenTrtError:
            suggestion = None
        if engine is None:
            engine_dir = find_engine_dir(gpu, versions=versions)
            stale = default_engines_dir() / suggestion if suggestion else None
            if engine_dir is None and stale is not None and (stale / "manifest.json").is_file():
                engine_dir = stale   # this GPU's folder, built with other libraries: say so below
            if engine_dir is None:
                target = suggestion or "<gpu>"
                raise EngineNotFoundError(
                    f"No TensorRT-LLM engine for this GPU ({gpu.describe()}) under "
                    f"{default_engines_dir()}/: build one with `make engine GPU={target}`, or "
                    f"pass --engine DIR, or use --backend torch.")
        else:
            engine_dir = Path(engine)
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
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise BackendUnavailableError(
                f"TensorRT-LLM could not load {engine_dir} ({type(e).__name__}: {first}); if the "
                f"driver or libraries changed, rebuild with `qwen-trt build --force --gpu "
                f"{suggestion or manifest['profile'].get('name', '<gpu>')}`.") from e
        backend = cls(runner, tokenizer, manifest, engine_dir, gpu.name)
        if warmup:
            backend.warmup()
        return backend

    def cancel(self) -> None:
        """Thread-safe: ask the executor to stop the running request now."""
        super().cancel()
        rid = self._active_id
        if rid is not None:
            try:
                self.runner.executor.cancel_request(rid)
            except Exception:  # noqa: BLE001 - already finished
                pass

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        import torch

        cancel = self._begin()
        n = len(prompt_ids)
        ids = request_ids_for(params, self._im_end, self._pad_id, self._info.stop_token_ids)
        stop_ids = self.stop_ids(params)
        # ModelRunnerCpp._fill_output pads every streamed item to ``self.max_seq_len`` in Python
        # lists (65536 ints per token on the h200 profile, ~1-4 ms of CPU per step); that
        # attribute only bounds _check_inputs and that padding (the executor has its own limits,
        # set in from_dir), so it is narrowed to this request while it runs.
        full_len = self.runner.max_seq_len
        self.runner.max_seq_len = n + params.max_new_tokens
        try:
            outputs = self.runner.generate(
                [torch.tensor(list(prompt_ids), dtype=torch.int32)],
                max_new_tokens=params.max_new_tokens, end_id=ids.end_id, pad_id=ids.pad_id,
                stop_words_list=[[[t] for t in ids.stop_words]] if ids.stop_words else None,
                streaming=True, return_dict=True, output_sequence_lengths=True,
                **sampling_kwargs(params))
        except BaseException as e:
            self.runner.max_seq_len = full_len
            if isinstance(e, RuntimeError):
                raise TrtllmRuntimeError(f"TensorRT-LLM rejected the request: {e}") from e
            raise
        recorded = self._recorder.last_ids
        self._active_id = recorded[0] if recorded else None
        deltas = OutputDeltas(n, params.max_new_tokens)
        emitted: list[int] = []
        finished = stopped = False
        try:
            for out in outputs:
                for tok in deltas.update(out):
                    if cancel.is_set():
                        break
                    emitted.append(tok)
                    if tok in stop_ids:
                        stopped = True
                    yield tok
                    if stopped:
                        break
                if stopped or cancel.is_set():
                    break
            else:
                finished = True
            if finished and not cancel.is_set():
                tail = final_stop_token(emitted, params.max_new_tokens, stop_ids, ids.end_id)
                if tail is not None:
                    stopped = True
                    yield tail
        except RuntimeError as e:
            finished = True   # the runner raised from an error response: request is over
            raise TrtllmRuntimeError(
                f"TensorRT-LLM request failed: {str(e).splitlines()[0] if str(e) else e}") from e
        finally:
            if not finished:
                self._finish(outputs, cancel_it=not stopped)
            self._active_id = None
            self.runner.max_seq_len = full_len

    def _finish(self, outputs, *, cancel_it: bool) -> None:
        """Cancel (unless it ended by itself) and drain the request so the runner is clean.

        The drain waits for the executor's final response, but at most ``drain_timeout_s``;
        responses that come later are dropped by :class:`_RequestIdRecorder`.
        """
        import time

        rid = self._active_id
        if cancel_it and rid is not None:
            try:
                self.runner.executor.cancel_request(rid)
            except Exception:  # noqa: BLE001 - finished in the meantime
                pass
        deadline = time.monotonic() + self.drain_timeout_s
        self._recorder.timeout_ms = 50
        try:
            for _ in outputs:
                if time.monotonic() > deadline:
                    break
        except Exception:  # noqa: BLE001 - a cancelled request may end with an error response
            pass
        finally:
            self._recorder.timeout_ms = None
            try:
                outputs.close()
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            try:
                runner.executor.shutdown()
            except Exception:  # noqa: BLE001
                pass


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
