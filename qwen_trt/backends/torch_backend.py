"""The ``torch`` backend: Hugging Face transformers on CPU or CUDA, the reference path.

Decoding is a plain loop in the caller's thread (prefill, then one forward per token with the
KV cache), so closing the generator or :meth:`cancel` stops work before the next token. Sampling
runs on the device with the fast path's sampler (:mod:`qwen_trt.fast.step.sampling`), so a seed
gives the same tokens on both; only the chosen token id crosses to the host (and its logprobs
when asked for). A grammar (:mod:`qwen_trt.fast.step.grammar`) fills the sampler's mask on the
host before each step and accepts each token after it.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from qwen_trt.backends.base import Backend, BackendInfo
from qwen_trt.model.template import default_stop_ids
from qwen_trt.errors import first_line, BackendUnavailableError, ModelSourceError
from qwen_trt.model.source import ModelSource, load_tokenizer, resolve_model
from qwen_trt.params import SamplingParams

DEFAULT_MAX_SEQ_LEN = 32768


def pick_device(device: str = "auto") -> str:
    """The device for a checked ``BackendConfig.device``; CUDA asked for but absent is an error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BackendUnavailableError(
            "--device cuda was asked for, but PyTorch sees no CUDA GPU here: use --device cpu, or "
            "install the CUDA build of torch on a machine with an NVIDIA driver.")
    return device


def pick_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return getattr(torch, dtype)


def context_limit(source: ModelSource, requested: int | None) -> int:
    """Prompt + reply limit: what was asked for (default 32768), never above the model's."""
    model_max = source.config.get("max_position_embeddings", DEFAULT_MAX_SEQ_LEN)
    return min(model_max, requested or DEFAULT_MAX_SEQ_LEN)


@dataclass(frozen=True)
class TorchLoad:
    """What both torch backends resolve before loading weights (:func:`prepare_torch_load`)."""

    source: ModelSource
    device: str           # "cpu", "cuda", "cuda:1"
    dtype: object         # torch.dtype
    tokenizer: object
    max_seq_len: int      # the context limit: asked for, never above the model's


def prepare_torch_load(model: str | None, device: str, dtype: str,
                       max_seq_len: int | None) -> TorchLoad:
    """The shared load preamble of the torch and torch-fast backends."""
    source = resolve_model(model)
    dev = pick_device(device)
    return TorchLoad(source=source, device=dev, dtype=pick_dtype(dtype, dev),
                     tokenizer=load_tokenizer(source.path, source.name),
                     max_seq_len=context_limit(source, max_seq_len))


def _cache_kwarg(model) -> str:
    """transformers 5.2x renamed ``past_key_values`` to ``cache``; 4.57 knows only the old name."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class TorchBackend(Backend):
    """transformers ``AutoModelForCausalLM`` with a KV cache and on-device sampling."""

    name = "torch"
    _device_attrs = ("model",)

    def __init__(self, source: ModelSource, model, tokenizer, device: str,
                 max_seq_len: int) -> None:
        super().__init__()
        self._cache_kw = _cache_kwarg(model)
        self.source = source
        self.model = model
        self._tokenizer = tokenizer
        self.device = device
        dev_name = "cpu"
        if device.startswith("cuda"):
            import torch

            dev_name = torch.cuda.get_device_name(torch.device(device))
        self._info = BackendInfo(
            name=self.name, model=source.name, device=dev_name,
            dtype=str(model.dtype).replace("torch.", ""),
            max_input_len=max_seq_len - 1, max_seq_len=max_seq_len,
            # no tokenizer: the benchmarks' bare model, which never stops early anyway
            stop_token_ids=default_stop_ids(tokenizer) if tokenizer is not None else (),
            grammar=tokenizer is not None, logprobs=True)

    @classmethod
    def load(cls, model: str | None = None, *, device: str = "auto", dtype: str = "auto",
             max_seq_len: int | None = None, warmup: bool = True) -> "TorchBackend":
        from transformers import AutoModelForCausalLM

        p = prepare_torch_load(model, device, dtype, max_seq_len)
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(p.source.path, dtype=p.dtype)
        except (OSError, ValueError) as e:
            raise ModelSourceError(first_line(f"Could not load '{p.source.name}': {e}")) from e
        hf_model.to(p.device).eval()
        backend = cls(p.source, hf_model, p.tokenizer, p.device, max_seq_len=p.max_seq_len)
        if warmup:
            backend.warmup()
        return backend

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        import torch
        from transformers import DynamicCache

        from qwen_trt.params import SampledToken
        from qwen_trt.fast.step.sampling import SamplerState, pick, sampler_kind

        cancel = self._begin()
        stop = self.stop_ids(params)
        kind = sampler_kind(params)
        constraint = self._constraint(params)
        with torch.inference_mode():
            ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
            cache = {self._cache_kw: DynamicCache(config=self.model.config)}
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache)
            logits = out.logits[:, -1, :]
            del out
            sampler = SamplerState(params.max_new_tokens, logits.shape[-1], self.device)
            sampler.set(params)
            for step in range(params.max_new_tokens):
                if constraint is not None:
                    constraint.fill(sampler.mask[0])
                tok = pick(logits, kind, sampler)           # [1] on device
                sampler.advance(tok, kind)
                tok_id = int(tok.item())                    # the one host sync per token
                if constraint is not None and not constraint.accept(tok_id):
                    from qwen_trt.fast.step.grammar import GrammarError

                    raise GrammarError(f"token {tok_id} broke the request's grammar")
                if params.logprobs is not None:
                    yield SampledToken(sampler.read_logprob(0, tok_id, params.logprobs))
                else:
                    yield tok_id
                if tok_id in stop or cancel.is_set():
                    return
                if step + 1 == params.max_new_tokens:
                    return
                out = self.model(input_ids=tok.view(1, 1), use_cache=True, **cache)
                logits = out.logits[:, -1, :]
                del out

    def _constraint(self, params: SamplingParams):
        """The request's grammar state (compiled against this tokenizer), or None."""
        if params.grammar is None:
            return None
        from qwen_trt.fast.step.grammar import grammar_book

        book = grammar_book(self, self._tokenizer, self.model.config.vocab_size,
                            self.info.stop_token_ids)
        return book.constraint(params.grammar, params.max_new_tokens)
