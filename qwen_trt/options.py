"""The backend options, one home for the app and the CLI.

``add_backend_args(parser)`` adds ``--model --engine --backend --device --dtype --max-seq-len
--max-batch --fast --watchdog-s --quantization --base-url --api-key`` to any argparse parser; ``config_from(args, environ)`` turns the parsed flags plus the
``QWEN_TRT_*`` environment variables into a checked :class:`BackendConfig` (a flag wins over its
variable; an empty variable counts as unset; with nothing given the backend's ``auto`` choice
applies). The values themselves are checked once, in ``BackendConfig.__post_init__``.

The app: ``streamlit run app.py -- --model ... --backend ...`` parses ``sys.argv[1:]`` with
:func:`app_parser`, which raises :class:`ConfigError` instead of exiting the server.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

from qwen_trt import settings
from qwen_trt.backends import BACKENDS, DTYPES, FAST_MODES, QUANTIZATIONS, BackendConfig
from qwen_trt.errors import ConfigError


@dataclass(frozen=True)
class BackendOption:
    flag: str
    env: str
    help: str

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


OPTIONS: tuple[BackendOption, ...] = (
    BackendOption("--model", "QWEN_TRT_MODEL",
                  "model folder or hub id (default Qwen/Qwen3-4B-Instruct-2507); for trtllm the "
                  "checkpoint of the LLM API path (no engine folder) or the engine's tokenizer"),
    BackendOption("--engine", "QWEN_TRT_ENGINE",
                  "TensorRT-LLM engine folder (default engines/<gpu>/)"),
    BackendOption("--backend", "QWEN_TRT_BACKEND", f"{' | '.join(BACKENDS)} (default auto)"),
    BackendOption("--device", "QWEN_TRT_DEVICE",
                  "torch backend: auto | cpu | cuda | cuda:N (default auto)"),
    BackendOption("--dtype", "QWEN_TRT_DTYPE",
                  f"torch backend: {' | '.join(DTYPES)} (default auto)"),
    BackendOption("--max-seq-len", "QWEN_TRT_MAX_SEQ_LEN",
                  "torch backend and the trtllm LLM API path: context limit in tokens, prompt + "
                  "reply (default: the model's; trtllm: this GPU's build profile)"),
    BackendOption("--max-batch", "QWEN_TRT_MAX_BATCH",
                  "fast path: sequences decoded together (continuous batching); 1 = one request "
                  "at a time on the batch-1 decoder, the lowest single-user latency (default 32)"),
    BackendOption("--speculative", "QWEN_TRT_SPECULATIVE",
                  "fast path: speculative decoding: off | ngram (draft-free prompt lookup: "
                  "several tokens a step where the reply repeats its context; exact) "
                  "(default off)"),
    BackendOption("--num-speculative-tokens", "QWEN_TRT_NUM_SPECULATIVE_TOKENS",
                  "fast path with --speculative: draft tokens verified a step, 1..8, or auto "
                  "(from each request's acceptance and the batch size; default auto)"),
    BackendOption("--fast", "QWEN_TRT_FAST",
                  f"torch backend: compiled CUDA-graph fast path: {' | '.join(FAST_MODES)} "
                  "(default auto = on CUDA)"),
    BackendOption("--watchdog-s", "QWEN_TRT_WATCHDOG_S",
                  "the engine process: restart it when it makes no progress for this many "
                  "seconds while requests wait or run (a hung GPU or process); 0 = off "
                  "(default 30)"),
    BackendOption("--quantization", "QWEN_TRT_QUANTIZATION",
                  f"fast path weights: {' | '.join(QUANTIZATIONS)} (default auto = as the "
                  "checkpoint has them; fp8 / int4 quantize a bf16 checkpoint at load)"),
    BackendOption("--cache-dir", "QWEN_TRT_CACHE_DIR",
                  "fast path on CUDA: where compiled kernels and autotune choices are kept "
                  "between starts, keyed by GPU, versions and shapes ('off': none; default "
                  "~/.cache/qwen-trt)"),
    BackendOption("--base-url", "QWEN_TRT_BASE_URL",
                  "openai backend: an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1"),
    BackendOption("--api-key", "QWEN_TRT_API_KEY",
                  "openai backend: the key to send; qwen-trt serve: the key clients must send"),
)


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    """Add the backend options (all default to None: unset, so the variable or default applies)."""
    for o in OPTIONS:
        parser.add_argument(o.flag, default=None, help=f"{o.help} [env {o.env}]")


def config_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None
                ) -> BackendConfig:
    """The checked backend settings from parsed flags and ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    if environ is None:
        settings.warn_unknown(env)          # a mistyped QWEN_TRT_* name: one line, once
    given = vars(args)

    def pick(o: BackendOption) -> str | None:
        val = given.get(o.dest)
        if val is None:
            val = settings.raw(o.env, env)
        val = val.strip() if isinstance(val, str) else val
        return val or None

    v = {o.dest: pick(o) for o in OPTIONS}
    max_seq_len = v["max_seq_len"]
    if max_seq_len is not None and max_seq_len.lstrip("-").isdigit():
        max_seq_len = int(max_seq_len)     # anything else is refused by BackendConfig
    max_batch = v["max_batch"]
    if max_batch is not None and max_batch.lstrip("-").isdigit():
        max_batch = int(max_batch)
    watchdog = v["watchdog_s"]
    if watchdog is not None:
        try:
            watchdog = float(watchdog)
        except ValueError:
            pass                           # BackendConfig refuses it, naming the option
    return BackendConfig(backend=v["backend"] or "auto", model=v["model"], engine=v["engine"],
                         device=v["device"] or "auto", dtype=v["dtype"] or "auto",
                         max_seq_len=max_seq_len, max_batch=max_batch, fast=v["fast"] or "auto",
                         base_url=v["base_url"], api_key=v["api_key"],
                         cache_dir=v["cache_dir"],
                         quantization=v["quantization"] or "auto",
                         speculative=v["speculative"] or "off",
                         num_speculative_tokens=v["num_speculative_tokens"] or "auto",
                         **({} if watchdog is None else {"watchdog_s": watchdog}))


class _AppParser(argparse.ArgumentParser):
    def error(self, message: str):  # never sys.exit() inside the Streamlit server
        raise ConfigError(f"Bad app option: {message}. Usage: {usage()}")


def usage() -> str:
    return "streamlit run app.py -- " + " ".join(f"[{o.flag} VALUE]" for o in OPTIONS)


def app_parser() -> argparse.ArgumentParser:
    """The app's parser for the arguments after ``--``: bad input raises ConfigError."""
    p = _AppParser(prog="app.py", add_help=False)
    add_backend_args(p)
    return p


def config_key(cfg: BackendConfig) -> str:
    """A stable text key for caching one loaded engine per distinct configuration."""
    return repr(cfg)
