"""Settings of the Streamlit app: ``streamlit run app.py -- --model ... --backend ...``.

Each option can also come from an environment variable; a command-line option wins over the
variable, and with nothing given the backend's ``auto`` choice applies (a built engine for this
GPU if there is one, else the default model on the torch backend).
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qwen_trt.backends import BACKENDS, BackendConfig
from qwen_trt.backends.fast_backend import FAST_MODES
from qwen_trt.backends.torch_backend import DTYPES
from qwen_trt.errors import QwenTrtError



@dataclass(frozen=True)
class AppOption:
    flag: str
    env: str
    help: str


OPTIONS: tuple[AppOption, ...] = (
    AppOption("--model", "QWEN_TRT_MODEL",
              "model folder or hub id (default Qwen/Qwen3-4B-Instruct-2507); the tokenizer "
              "source for the trtllm backend"),
    AppOption("--engine", "QWEN_TRT_ENGINE", "TensorRT-LLM engine folder (default engines/<gpu>/)"),
    AppOption("--backend", "QWEN_TRT_BACKEND", f"{' | '.join(BACKENDS)} (default auto)"),
    AppOption("--device", "QWEN_TRT_DEVICE", "torch backend: auto | cpu | cuda | cuda:N (default auto)"),
    AppOption("--dtype", "QWEN_TRT_DTYPE", f"torch backend: {' | '.join(DTYPES)} (default auto)"),
    AppOption("--max-seq-len", "QWEN_TRT_MAX_SEQ_LEN",
              "torch backend: context limit in tokens, prompt + reply (default: the model's)"),
    AppOption("--fast", "QWEN_TRT_FAST",
              "torch backend: compiled CUDA-graph fast path: auto | on | off (default auto = on CUDA)"),
)


class AppConfigError(QwenTrtError):
    """A bad app option or environment variable."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # never sys.exit() inside the Streamlit server
        raise AppConfigError(f"Bad app option: {message}. Usage: {usage()}")


def usage() -> str:
    return ("streamlit run app.py -- " + " ".join(f"[{o.flag} VALUE]" for o in OPTIONS))


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="app.py", add_help=False)
    for o in OPTIONS:
        p.add_argument(o.flag, default=None)
    return p


def parse_app_config(argv: Sequence[str] = (), environ: Mapping[str, str] | None = None
                     ) -> BackendConfig:
    """The backend settings from ``argv`` (the arguments after ``--``) and ``environ``."""
    env = os.environ if environ is None else environ
    args = vars(_parser().parse_args(list(argv)))

    def pick(o: AppOption) -> str | None:
        val = args[o.flag.lstrip("-").replace("-", "_")]
        if val is None:
            val = env.get(o.env) or None
        return val.strip() if isinstance(val, str) else val

    values = {o.flag: pick(o) for o in OPTIONS}
    backend = values["--backend"] or "auto"
    if backend not in BACKENDS:
        raise AppConfigError(f"Unknown backend '{backend}' (from --backend or QWEN_TRT_BACKEND): "
                             f"use one of {', '.join(BACKENDS)}.")
    dtype = values["--dtype"] or "auto"
    if dtype not in DTYPES:
        raise AppConfigError(f"Unknown dtype '{dtype}' (from --dtype or QWEN_TRT_DTYPE): "
                             f"use one of {', '.join(DTYPES)}.")
    fast = values["--fast"] or "auto"
    if fast not in FAST_MODES:
        raise AppConfigError(f"Unknown fast mode '{fast}' (from --fast or QWEN_TRT_FAST): "
                             f"use one of {', '.join(FAST_MODES)}.")
    max_seq_len = None
    if values["--max-seq-len"]:
        try:
            max_seq_len = int(values["--max-seq-len"])
        except ValueError:
            max_seq_len = -1
        if max_seq_len < 2:
            raise AppConfigError(f"--max-seq-len / QWEN_TRT_MAX_SEQ_LEN must be a whole number "
                                 f"of tokens >= 2, got '{values['--max-seq-len']}'.")
    return BackendConfig(backend=backend, model=values["--model"], engine=values["--engine"],
                         device=values["--device"] or "auto", dtype=dtype,
                         max_seq_len=max_seq_len, fast=fast)


def config_key(cfg: BackendConfig) -> str:
    """A stable text key for caching one loaded engine per distinct configuration."""
    return repr(cfg)
