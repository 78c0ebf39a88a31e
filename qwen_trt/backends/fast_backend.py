"""The torch backend's fast path: our compact Qwen3 (:mod:`qwen_trt.fast`) behind the same
:class:`Backend` contract. ``BackendConfig(fast="auto")`` picks it on CUDA; on CPU it runs
eagerly (used by the tests); ``fast="off"`` keeps the HF transformers reference path."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from qwen_trt.backends.base import Backend, BackendInfo
from qwen_trt.backends.runner import Runner, generate
from qwen_trt.backends.torch_backend import prepare_torch_load
from qwen_trt.model.template import default_stop_ids
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
                                 stop_token_ids=default_stop_ids(tokenizer),
                                 grammar=True, logprobs=True)

    @classmethod
    def load(cls, model: str | None = None, *, device: str = "auto", dtype: str = "auto",
             max_seq_len: int | None = None, warmup: bool = True,
             for_runner: bool = False, quantization: str = "auto",
             cache_dir: str | None = None, max_batch: int | None = None) -> "FastBackend":
        """``for_runner``: the caller serves through :meth:`runner` (the worker with
        ``--max-batch`` other than 1), which drops the batch-1 decoder's static cache and CUDA
        graphs; their compile and capture (about 15 s on an H200) is then skipped. The Triton
        self-checks still run (the decoder's constructor: the runner relies on them), and the
        runner's own warm-up captures its batch buckets when it is built. ``quantization``:
        the projections' format (:func:`qwen_trt.fast.loader.resolve_quant`). ``cache_dir``: the
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
                                    max_seq_len=p.max_seq_len, warmup=warmup and not for_runner,
                                    quantization=quantization)
        backend = cls(p.source, decoder, p.tokenizer)
        backend._compile_cache = cache
        st = decoder.stats
        _say(f"weights on {p.device} in {st.load_s:.1f} s, kernel self-checks {st.checks_s:.1f} s"
             + (f", decoder warm-up {st.warmup_s:.1f} s" if st.warmup_s else ""))
        if warmup and not for_runner:
            close_after_warmup(cache, say=_say)
        return backend

    def take_model(self):
        """Hand the weights to a continuous-batching runner (``qwen_trt.serving.scheduler``):
        the batch-1 decoder's static cache and CUDA graphs are dropped; the model is returned."""
        dec = self.decoder
        dec._decode_graphs.clear()      # they replay the static cache, which the runner frees
        dec._prefill_graphs.clear()
        return dec.model

    def attach_runner(self, runner: Runner) -> None:
        """From now on :meth:`stream` goes through ``runner`` (built over :meth:`take_model`,
        its warm-up done: the compile cache is written now)."""
        from qwen_trt.fast.compile_cache import close_after_warmup

        self._runner = runner
        stats = getattr(getattr(runner, "model", None), "stats", None)
        phases = getattr(stats, "phases_s", None)
        if phases:
            _say("batched warm-up " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
        close_after_warmup(getattr(self, "_compile_cache", None), say=_say)

    @property
    def attached_runner(self) -> Runner | None:
        return self._runner

    def grammars(self):
        """This tokenizer's GrammarBook (built on the first constrained request)."""
        from qwen_trt.fast.grammar import grammar_book

        return grammar_book(self, self._tokenizer, self.decoder.model.cfg.vocab_size,
                            self.info.stop_token_ids)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        cancel = self._begin()
        if self._runner is not None:
            for tok in generate(self._runner, prompt_ids, params):
                yield tok
                if cancel.is_set():
                    return
            return
        constraint = (self.grammars().constraint(params.grammar, params.max_new_tokens)
                      if params.grammar is not None else None)
        yield from self.decoder.generate(prompt_ids, params, cancel, stop_ids=self.stop_ids(params),
                                         constraint=constraint)
