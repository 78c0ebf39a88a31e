"""The torch backend's fast path: our compact Qwen3 (:mod:`qwen_trt.fast`) behind the same
:class:`Backend` contract. ``BackendConfig(fast="auto")`` picks it on CUDA; on CPU it runs
eagerly (used by the tests); ``fast="off"`` keeps the HF transformers reference path."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from qwen_trt.backends.base import Backend, BackendInfo
from qwen_trt.backends.torch_backend import prepare_torch_load
from qwen_trt.chat.template import default_stop_ids
from qwen_trt.model.source import ModelSource
from qwen_trt.params import SamplingParams

def _say(line: str) -> None:
    import sys

    print(f"[qwen-trt engine] {line}", file=sys.stderr, flush=True)


def use_fast(mode: str, device: str) -> bool:
    """Whether ``mode`` (a checked ``BackendConfig.fast``) selects the fast path on ``device``
    (already resolved, e.g. 'cuda')."""
    if mode == "auto":
        return device.startswith("cuda")
    return mode == "on"


class FastBackend(Backend):
    """Compiled, graph-replayed Qwen3 on CUDA (eager on CPU); name ``torch-fast``."""

    name = "torch-fast"
    _device_attrs = ("decoder", "_runner")

    def __init__(self, source: ModelSource, decoder, tokenizer) -> None:
        super().__init__()
        import torch

        self.source = source
        self.decoder = decoder
        self._tokenizer = tokenizer
        dev = decoder.device
        dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        n = decoder.max_seq_len
        self._runner = None
        self._info = BackendInfo(name=self.name, model=source.name, device=dev_name,
                                 dtype=str(decoder.model.dtype).replace("torch.", ""),
                                 max_input_len=n - 1, max_seq_len=n,
                                 stop_token_ids=default_stop_ids(tokenizer))

    @classmethod
    def load(cls, model: str | None = None, *, device: str = "auto", dtype: str = "auto",
             max_seq_len: int | None = None, warmup: bool = True,
             for_runner: bool = False, cache_dir: str | None = None,
             max_batch: int | None = None) -> "FastBackend":
        """``for_runner``: the caller serves through :meth:`runner` (the worker with
        ``--max-batch`` other than 1), which drops the batch-1 decoder's static cache and CUDA
        graphs; their compile and capture (about 15 s on an H200) is then skipped. The Triton
        self-checks still run (the decoder's constructor: the runner relies on them), and the
        runner's own warm-up captures its batch buckets when it is built. ``cache_dir``: the
        compile cache's root (:mod:`qwen_trt.fast.compile_cache`; on CUDA only), keyed with
        ``max_batch`` among the rest."""
        from qwen_trt.fast import FastConfig, load_fast_decoder
        from qwen_trt.fast.compile_cache import close_after_warmup, open_for_fast_path

        p = prepare_torch_load(model, device, dtype, max_seq_len)
        cfg = FastConfig.from_hf(p.source.config, f"'{p.source.name}'/config.json")
        cache = open_for_fast_path(cfg, p.dtype, p.device, cache_dir=cache_dir,
                                   buckets=f"runner={for_runner} max_batch={max_batch} "
                                           f"max_seq_len={p.max_seq_len}", say=_say)
        decoder = load_fast_decoder(cfg, weights=p.source.path, dtype=p.dtype, device=p.device,
                                    max_seq_len=p.max_seq_len, warmup=warmup and not for_runner)
        backend = cls(p.source, decoder, p.tokenizer)
        backend._compile_cache = cache
        if warmup and not for_runner:
            close_after_warmup(cache, say=_say)
        return backend

    def runner(self, config=None, *, kv_tokens: int | None = None):
        """The continuous-batching runner over this backend's weights
        (:class:`qwen_trt.serving.scheduler.BatchRunner`), built on first call. It replaces the
        batch-1 decoder's static cache and graphs; :meth:`stream` then goes through it too."""
        if self._runner is None:
            from qwen_trt.fast.compile_cache import close_after_warmup
            from qwen_trt.serving.scheduler import make_batch_runner

            dec = self.decoder
            dec._decode_graphs.clear()      # they replay the static cache, freed below
            dec._prefill_graphs.clear()
            self._runner = make_batch_runner(dec.model, config, kv_tokens=kv_tokens,
                                             checked=True, stop_ids=self.info.stop_token_ids)
            close_after_warmup(getattr(self, "_compile_cache", None), say=_say)
        return self._runner

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        cancel = self._begin()
        if self._runner is not None:
            from qwen_trt.serving.scheduler import generate

            for tok in generate(self._runner, prompt_ids, params):
                yield tok
                if cancel.is_set():
                    return
            return
        yield from self.decoder.generate(prompt_ids, params, cancel, stop_ids=self.stop_ids(params))
