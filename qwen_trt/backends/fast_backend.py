"""The torch backend's fast path: our compact Qwen3 (:mod:`qwen_trt.fast`) behind the same
:class:`Backend` contract. ``BackendConfig(fast="auto")`` picks it on CUDA; on CPU it runs
eagerly (used by the tests); ``fast="off"`` keeps the HF transformers reference path."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from qwen_trt.backends.base import Backend, BackendInfo
from qwen_trt.backends.runner import Runner, generate
from qwen_trt.model.template import default_stop_ids
from qwen_trt.model.source import ModelSource
from qwen_trt.params import SamplingParams

class _Background:
    """``fn(*args)`` on a daemon thread; :meth:`result` joins it and returns its value or
    raises its exception (a broken tokenizer is the same one-line error as loaded inline)."""

    def __init__(self, fn, *args, name: str) -> None:
        import threading

        self._value = self._error = None
        self.seconds = 0.0

        def run() -> None:
            import time

            t = time.perf_counter()
            try:
                self._value = fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised by result()
                self._error = e
            self.seconds = time.perf_counter() - t

        self._thread = threading.Thread(target=run, daemon=True, name=name)
        self._thread.start()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _check_tokenizer(source: ModelSource) -> tuple[int, ...] | None:
    """What :func:`~qwen_trt.model.source.resolve_model` left out (``check_tokenizer=False``:
    tokenizer.json parsed and checked, in Rust) and the stop ids it gives
    (:func:`~qwen_trt.model.template.stop_ids_from_files`); no transformers import."""
    from qwen_trt.model.source import check_tokenizer_files
    from qwen_trt.model.template import stop_ids_from_files

    parsed = check_tokenizer_files(source.path, source.config.get("vocab_size"))
    return stop_ids_from_files(parsed, source.path)


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
    load_stages: dict[str, float] = {}   # seconds per part of load() (set by load)

    def __init__(self, source: ModelSource, decoder, tokenizer=None,
                 stop_ids: tuple[int, ...] | None = None) -> None:
        """``tokenizer``: the Hugging Face tokenizer, or None to load it on first use (the
        engine process needs it only for grammars; ``stop_ids`` then come from the files)."""
        super().__init__()
        import threading

        import torch

        self.source = source
        self.decoder = decoder
        self._tokenizer = tokenizer
        self._tokenizer_lock = threading.Lock()
        if stop_ids is None:
            stop_ids = default_stop_ids(self.tokenizer)
        dev = decoder.device
        dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        n = decoder.max_seq_len
        self._runner = None
        self._info = BackendInfo(name=self.name, model=source.name, device=dev_name,
                                 dtype=str(decoder.model.dtype).replace("torch.", ""),
                                 max_input_len=n - 1, max_seq_len=n,
                                 stop_token_ids=tuple(stop_ids),
                                 grammar=True, logprobs=True)

    @classmethod
    def load(cls, model: str | None = None, *, device: str = "auto", dtype: str = "auto",
             max_seq_len: int | None = None, warmup: bool = True,
             for_runner: bool = False, quantization: str = "auto",
             cache_dir: str | None = None, max_batch: int | None = None) -> "FastBackend":
        """``for_runner``: the caller serves through :meth:`runner` (the worker with
        ``--max-batch`` other than 1), which drops the batch-1 decoder's static cache and CUDA
        graphs; their compile and capture (about 15 s on an H200) is then skipped. The Triton
        self-checks still run (the decoder's constructor: the runner relies on them) unless the
        warm compile cache recorded them passing (:mod:`qwen_trt.fast.compile_cache`), and the
        runner's own warm-up captures its batch buckets when it is built. ``quantization``:
        the projections' format (:func:`qwen_trt.fast.loader.resolve_quant`). ``cache_dir``: the
        compile cache's root (:mod:`qwen_trt.fast.compile_cache`; on CUDA only), keyed with
        ``max_batch`` among the rest.

        tokenizer.json's parse and check (Rust) and the stop ids run on a thread while this
        one initialises CUDA and reads the weights; the Hugging Face tokenizer itself (the
        transformers import and the chat template's check: seconds, most of them holding the
        GIL, which slowed the weights' read threefold when it ran beside them) loads after the
        rest, or, ``for_runner`` (the engine process, whose parent has its own), on first use
        of :attr:`tokenizer` (the worker preloads it once it is serving). Where the seconds
        went is kept in :attr:`load_stages` (the worker adds it to its "ready in" line)."""
        import torch

        from qwen_trt.backends.torch_backend import context_limit, pick_device, pick_dtype
        from qwen_trt.model.source import resolve_model
        from qwen_trt.progress import StageClock

        clock = StageClock()
        source = resolve_model(model, check_tokenizer=False)
        clock.mark("resolve_s")
        tokenizer = _Background(_check_tokenizer, source, name="qwen-trt-tokenizer")
        dev = pick_device(device)
        if dev.startswith("cuda"):         # the context, now: beside the tokenizer's load
            torch.zeros(1, device=dev)
        clock.mark("cuda_init_s")
        torch_dtype = pick_dtype(dtype, dev)
        n = context_limit(source, max_seq_len)
        from qwen_trt.fast import FastConfig, load_fast_decoder
        from qwen_trt.fast.compile_cache import (
            buckets_key,
            close_after_warmup,
            format_key,
            open_for_fast_path,
        )
        from qwen_trt.fast.loader import resolve_quant
        clock.mark("fast_import_s")

        cfg = FastConfig.from_hf(source.config, f"'{source.name}'/config.json")
        cache = open_for_fast_path(cfg, torch_dtype, dev, cache_dir=cache_dir,
                                   buckets=buckets_key(for_runner=for_runner,
                                                       max_batch=max_batch, max_seq_len=n),
                                   say=_say,
                                   weights=source.path,
                                   weight_format=format_key(resolve_quant(source.path,
                                                                          quantization)))
        clock.mark("cache_open_s")
        from qwen_trt.fast.options import options

        # the runner takes the model over and prefills with its own step pieces: with those as
        # Triton kernels (or plain ops) the batch-1 decoder's compiled prefill would only
        # import dynamo
        opts = options()
        no_compile = (for_runner and dev.startswith("cuda")
                      and (opts.step_triton or not opts.step_compile))
        decoder = load_fast_decoder(cfg, weights=source.path, dtype=torch_dtype, device=dev,
                                    max_seq_len=n, warmup=warmup and not for_runner,
                                    quantization=quantization,
                                    compile=False if no_compile else None)
        dt = clock.mark("decoder_s")
        st = decoder.stats
        clock.parts.pop("decoder_s")
        clock.add("weights_s", st.load_s)
        for name, secs in st.checks_parts.items():
            clock.add(name, secs)
        if st.warmup_s:
            clock.add("decoder_warmup_s", st.warmup_s)
        clock.add("decoder_other_s", max(0.0, dt - st.load_s - st.checks_s - st.warmup_s))
        stop_ids = tokenizer.result()
        clock.mark("tokenizer_wait_s")
        clock.add("tokenizer_thread_s", tokenizer.seconds)   # beside the above, not after
        backend = cls(source, decoder, None, stop_ids=stop_ids)
        backend._compile_cache = cache
        _say(f"weights on {dev} in {st.load_s:.1f} s, kernel self-checks {st.checks_s:.1f} s"
             + (f" ({st.checks_note})" if st.checks_note else "")
             + (f", decoder warm-up {st.warmup_s:.1f} s" if st.warmup_s else ""))
        if warmup and not for_runner:
            close_after_warmup(cache, say=_say)
        clock.mark("backend_s")
        if not for_runner:          # in process: the caller encodes at once (the app, benches)
            backend.tokenizer
            clock.mark("hf_tokenizer_s")
        backend.load_stages = dict(clock.parts)
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
    def tokenizer(self):
        """The Hugging Face tokenizer (chat template included), loaded on first use."""
        if self._tokenizer is None:
            with self._tokenizer_lock:
                if self._tokenizer is None:
                    from qwen_trt.model.source import load_tokenizer

                    self._tokenizer = load_tokenizer(self.source.path, self.source.name)
        return self._tokenizer

    @property
    def tokenizer_source(self) -> str:
        return str(self.source.path)

    @property
    def attached_runner(self) -> Runner | None:
        return self._runner

    def grammars(self):
        """This tokenizer's GrammarBook (built on the first constrained request)."""
        from qwen_trt.fast.step.grammar import grammar_book

        return grammar_book(self, self.tokenizer, self.decoder.model.cfg.vocab_size,
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
