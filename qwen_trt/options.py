"""The backend options, one home for the app and the CLI.

``add_backend_args(parser)`` adds ``--model --engine --backend --device --dtype --max-seq-len
--max-batch --fast --watchdog-s --quantization --cache-dir --base-url --api-key`` to any argparse
parser, their help from their declarations in :mod:`qwen_trt.settings`;
``config_from(args, environ)`` turns the parsed flags plus the ``QWEN_TRT_*`` environment variables into a checked :class:`BackendConfig` (a flag wins over its
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
from qwen_trt.backends import BackendConfig
from qwen_trt.errors import ConfigError


@dataclass(frozen=True)
class BackendOption:
    flag: str
    env: str

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def help(self) -> str:
        """The flag's ``--help``: its declaration's doc and default (qwen_trt.settings)."""
        return settings.declared(self.env).help


_BACKEND_ENVS = (
    "QWEN_TRT_MODEL", "QWEN_TRT_ENGINE", "QWEN_TRT_BACKEND", "QWEN_TRT_DEVICE", "QWEN_TRT_DTYPE",
    "QWEN_TRT_MAX_SEQ_LEN", "QWEN_TRT_MAX_BATCH", "QWEN_TRT_SPECULATIVE",
    "QWEN_TRT_NUM_SPECULATIVE_TOKENS", "QWEN_TRT_FAST", "QWEN_TRT_WATCHDOG_S",
    "QWEN_TRT_QUANTIZATION", "QWEN_TRT_CACHE_DIR", "QWEN_TRT_BASE_URL", "QWEN_TRT_API_KEY")
OPTIONS: tuple[BackendOption, ...] = tuple(
    BackendOption(settings.declared(env).flag, env) for env in _BACKEND_ENVS)


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    """Add the backend options (all default to None: unset, so the variable or default applies)."""
    for o in OPTIONS:
        parser.add_argument(o.flag, default=None, help=o.help)


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
