"""The torch backend's fast path: our compact Qwen3 (:mod:`qwen_trt.fast`) behind the same
:class:`Backend` contract. ``BackendConfig(fast="auto")`` picks it on CUDA; on CPU it runs
eagerly (used by the tests); ``fast="off"`` keeps the HF transformers reference path."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from qwen_trt.backends.base import Backend, BackendInfo
from qwen_trt.backends.torch_backend import (context_limit, load_tokenizer, pick_device,
                                             pick_dtype)
from qwen_trt.chat.template import default_stop_ids
from qwen_trt.model.source import ModelSource, resolve_model
from qwen_trt.params import SamplingParams

def use_fast(mode: str, device: str) -> bool:
    """Whether ``mode`` (a checked ``BackendConfig.fast``) selects the fast path on ``device``
    (already resolved, e.g. 'cuda')."""
    if mode == "auto":
        return device.startswith("cuda")
    return mode == "on"


class FastBackend(Backend):
    """Compiled, graph-replayed Qwen3 on CUDA (eager on CPU); name ``torch-fast``."""

    name = "torch-fast"

    def __init__(self, source: ModelSource, decoder, tokenizer) -> None:
        super().__init__()
        import torch

        self.source = source
        self.decoder = decoder
        self._tokenizer = tokenizer
        dev = decoder.device
        dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        n = decoder.max_seq_len
        self._info = BackendInfo(name=self.name, model=source.name, device=dev_name,
                                 dtype=str(decoder.model.dtype).replace("torch.", ""),
                                 max_input_len=n - 1, max_seq_len=n,
                                 stop_token_ids=default_stop_ids(tokenizer))

    @classmethod
    def load(cls, model: str | None = None, *, device: str = "auto", dtype: str = "auto",
             max_seq_len: int | None = None, warmup: bool = True) -> "FastBackend":
        from qwen_trt.fast import FastConfig, load_fast_decoder

        source = resolve_model(model)
        device = pick_device(device)
        torch_dtype = pick_dtype(dtype, device)
        cfg = FastConfig.from_hf(source.config)
        tokenizer = load_tokenizer(source)
        decoder = load_fast_decoder(cfg, weights=source.path, dtype=torch_dtype, device=device,
                                  max_seq_len=context_limit(source, max_seq_len), warmup=warmup)
        return cls(source, decoder, tokenizer)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        cancel = self._begin()
        yield from self.decoder.generate(prompt_ids, params, cancel, stop_ids=self.stop_ids(params))

    def close(self) -> None:
        import torch

        self.decoder = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
