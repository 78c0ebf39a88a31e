"""The one interface every inference engine implements.

A backend is loaded once and then serves one request at a time (callers serialise access,
see :mod:`qwen_trt.serving.service`). ``stream`` is a generator of new token ids:

* callers check the request first with :meth:`Backend.check_request` (``ReplyStream`` does);
* it yields each generated token id as soon as it is known, in order; when ``params.logprobs``
  is set, each as a :class:`SampledToken` (the id, an ``int``, carrying its ``logprob``);
* with ``params.grammar`` every token is one the grammar allows (backends that cannot
  constrain raise a one-line error instead);
* when a stop token (:meth:`Backend.stop_ids`) is generated it is yielded (so the caller can tell "stop" from "length")
  and the generator returns; unless ``params.ignore_eos``;
* it never yields more than ``params.max_new_tokens`` ids;
* closing the generator (``gen.close()``) or calling :meth:`Backend.cancel` stops device work
  before the next token and frees the backend for the next request.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from qwen_trt.errors import EmptyMessageError, PromptTooLongError, QwenTrtError
from qwen_trt.params import SampledToken, SamplingParams, TokenLogprob, fit_problem  # noqa: F401


class UnsupportedRequestError(QwenTrtError, ValueError):
    """The request asks for something this backend cannot do (a grammar, logprobs)."""


@dataclass(frozen=True)
class BackendInfo:
    """What the UI shows about the engine in use."""

    name: str                 # "torch" | "trtllm" | ...
    model: str                # model folder, hub id or engine folder
    device: str               # "cpu", "NVIDIA H200", ...
    dtype: str                # "float32", "bfloat16", "float16"
    max_input_len: int        # longest prompt accepted, in tokens
    max_seq_len: int          # prompt + new tokens
    stop_token_ids: tuple[int, ...]   # resolved once at load (model.template.default_stop_ids)
    max_concurrency: int = 1  # requests the backend serves at once (trtllm: in-flight batching)
    path: str | None = None   # trtllm: "engine" (a TensorRT engine) or "llmapi" (the checkpoint
                              # through TensorRT-LLM's PyTorch-backend LLM API)
    grammar: bool = False     # honours SamplingParams.grammar (constrained decoding)
    logprobs: bool = False    # reports SamplingParams.logprobs
    # the fast path: kernel family -> the path it runs, and -> why it fell back to a slower one
    # (qwen_trt.backends.kernel_paths; empty for other backends)
    kernels: dict = field(default_factory=dict, compare=False)
    slow_kernels: dict = field(default_factory=dict, compare=False)

    def describe(self) -> str:
        name = f"{self.name} ({PATH_LABELS.get(self.path, self.path)})" if self.path else self.name
        return f"{name} · {self.model} · {self.device} · {self.dtype} · ctx {self.max_seq_len}"


PATH_LABELS = {"engine": "TensorRT engine", "llmapi": "LLM API, PyTorch backend"}


class Backend(ABC):
    """Load once, then stream token ids for a prompt."""

    _info: BackendInfo
    _tokenizer: object

    def __init__(self) -> None:
        self._cancel = threading.Event()

    @property
    def info(self) -> BackendInfo:
        """Set by each implementation as ``self._info`` when it loads."""
        return self._info

    @property
    def tokenizer(self):
        """The Hugging Face tokenizer that matches the model (chat template included)."""
        return self._tokenizer

    @property
    def tokenizer_source(self) -> str:
        """Where the tokenizer comes from (a folder or hub id), without loading it."""
        return getattr(self.tokenizer, "name_or_path", "") or ""

    def warmup(self) -> None:
        """One short greedy request at load time, so the first user request pays no lazy init."""
        ids = self.tokenizer.encode("warm up", add_special_tokens=False)
        for _ in self.stream(ids, SamplingParams(max_new_tokens=2, temperature=0)):
            pass

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """The one check of a request against this backend's limits, before :meth:`stream`."""
        n, info = len(prompt_ids), self.info
        problem = fit_problem(n, params.max_new_tokens, info.max_input_len, info.max_seq_len)
        if problem:
            raise (EmptyMessageError if n == 0 else PromptTooLongError)(problem)
        if params.grammar is not None and not info.grammar:
            raise UnsupportedRequestError(
                f"The {info.name} backend cannot constrain its output to a grammar "
                f"({params.grammar.kind}); use the torch backend.")
        if params.logprobs is not None and not info.logprobs:
            raise UnsupportedRequestError(
                f"The {info.name} backend does not report logprobs; use the torch backend.")

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The ids that end this request (:meth:`SamplingParams.stop_ids` over this backend's)."""
        return params.stop_ids(self.info.stop_token_ids)

    @abstractmethod
    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Yield new token ids for ``prompt_ids``; see the module docstring for the contract."""

    def cancel(self) -> None:
        """Ask the running ``stream`` to stop before its next token (thread-safe)."""
        self._cancel.set()

    def _begin(self) -> threading.Event:
        """Implementations call this at the start of ``stream`` to clear an old cancel."""
        self._cancel.clear()
        return self._cancel

    _device_attrs: tuple[str, ...] = ()   # what holds device memory (dropped by close)

    def close(self) -> None:
        """Free device memory: drop what ``_device_attrs`` names, then return the CUDA cache."""
        for name in self._device_attrs:
            setattr(self, name, None)
        release_cuda_cache()


def release_cuda_cache() -> None:
    """Give cached CUDA blocks back (no-op without torch or CUDA; never imports torch)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
