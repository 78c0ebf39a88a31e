"""Every ``QWEN_TRT_*`` environment variable, declared once: name, type, default, one-line doc.

This module imports nothing of ``qwen_trt``, so every layer (the fast path's kernels included)
can read its settings here. :func:`get` parses a variable by its declaration (an empty value
counts as unset); a bad value raises :class:`SettingError` (a ``ValueError``) naming the
variable. :func:`unknown` lists the ``QWEN_TRT_*`` names in an environment that no declaration
knows, and :func:`warn_unknown` prints one line for them (a mistyped name would otherwise be
ignored silently). The README's configuration table is checked against :data:`SETTINGS` by
``tests/test_settings.py``.

Groups: ``user`` (the backend and server options; the CLI flags of the same name win),
``app`` (the Streamlit app), ``build`` (engine build and container), ``kernel`` (switches of
the fast path, read once when its kernels are configured: :mod:`qwen_trt.fast.options`),
``test`` (the test suite and its tools).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Group = Literal["user", "app", "build", "kernel", "test"]
Kind = Literal["str", "int", "float", "bool", "path"]
PREFIX = "QWEN_TRT_"


class SettingError(ValueError):
    """An environment variable holds a value its declaration does not allow."""


@dataclass(frozen=True)
class Setting:
    name: str                    # the variable, QWEN_TRT_...
    kind: Kind
    default: object
    doc: str                     # one line
    group: Group = "user"
    flag: str | None = None      # the CLI flag that sets the same value (it wins)
    choices: tuple[str, ...] = ()
    pattern: bool = False        # name is a prefix: QWEN_TRT_GEMV_<N>x<K>

    def parse(self, raw: str) -> object:
        raw = raw.strip()
        try:
            if self.kind == "int":
                return int(raw)
            if self.kind == "float":
                return float(raw)
            if self.kind == "bool":
                low = raw.lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ValueError
        except ValueError:
            raise SettingError(f"{self.name}={raw!r}: expected {_KIND_WORDS[self.kind]}") from None
        if self.choices and raw not in self.choices:
            raise SettingError(f"{self.name}={raw!r}: expected one of {', '.join(self.choices)}")
        return raw


_KIND_WORDS = {"int": "a whole number", "float": "a number", "bool": "1 or 0",
               "str": "text", "path": "a path"}

_S = Setting
SETTINGS: tuple[Setting, ...] = (
    # -- the backend (qwen_trt.options; app and CLI) ---------------------------------------------
    _S("QWEN_TRT_MODEL", "str", None, "model folder or hub id (default Qwen/Qwen3-4B-Instruct-2507)",
       flag="--model"),
    _S("QWEN_TRT_BACKEND", "str", "auto", "auto | torch | trtllm | openai", flag="--backend",
       choices=("auto", "torch", "trtllm", "openai")),
    _S("QWEN_TRT_ENGINE", "path", None, "TensorRT-LLM engine folder (default engines/<gpu>/)",
       flag="--engine"),
    _S("QWEN_TRT_DEVICE", "str", "auto", "torch device: auto | cpu | cuda | cuda:N",
       flag="--device"),
    _S("QWEN_TRT_DTYPE", "str", "auto", "torch dtype: auto | float32 | bfloat16 | float16",
       flag="--dtype", choices=("auto", "float32", "bfloat16", "float16")),
    _S("QWEN_TRT_MAX_SEQ_LEN", "int", None, "context limit in tokens, prompt + reply (torch)",
       flag="--max-seq-len"),
    _S("QWEN_TRT_MAX_BATCH", "int", None,
       "chats decoded together on the fast path (default 32; 1 = the batch-1 decoder)",
       flag="--max-batch"),
    _S("QWEN_TRT_FAST", "str", "auto", "torch fast path: auto | on | off", flag="--fast",
       choices=("auto", "on", "off")),
    _S("QWEN_TRT_BASE_URL", "str", None,
       "openai backend: an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1",
       flag="--base-url"),
    _S("QWEN_TRT_API_KEY", "str", None,
       "the key sent (openai backend) or required (qwen-trt serve)", flag="--api-key"),
    _S("QWEN_TRT_WORKER", "str", "process",
       "process: the engine in its own worker process; inline: in this process",
       choices=("process", "inline")),
    _S("QWEN_TRT_DEBUG", "bool", False,
       "print the traceback behind an error line (the same as qwen-trt --debug)", flag="--debug"),
    _S("QWEN_TRT_QUANTIZATION", "str", "auto",
       "fast path weights: auto (as the checkpoint has them) | none | fp8 | int4 (at load)",
       flag="--quantization", choices=("auto", "none", "fp8", "int4")),
    _S("QWEN_TRT_CACHE_DIR", "path", None,
       "fast path on CUDA: compiled kernels and autotune choices kept between starts "
       "(default ~/.cache/qwen-trt; off: none)", flag="--cache-dir"),
    _S("QWEN_TRT_WATCHDOG_S", "float", 30.0,
       "restart the worker when it makes no progress for this long with work queued (0 = off)",
       flag="--watchdog-s"),
    # -- qwen-trt serve ---------------------------------------------------------------------------
    _S("QWEN_TRT_HOST", "str", "127.0.0.1", "address qwen-trt serve binds (non-loopback needs a key)",
       flag="--host"),
    _S("QWEN_TRT_PORT", "int", 8000, "port of qwen-trt serve", flag="--port"),
    _S("QWEN_TRT_MAX_QUEUE", "int", 256,
       "requests qwen-trt serve lets wait for the engine (then 503 + Retry-After)",
       flag="--max-queue"),
    _S("QWEN_TRT_SSE_KEEPALIVE_S", "float", 10.0,
       "seconds between ': keep-alive' comments on a waiting stream (0 = off)",
       flag="--sse-keepalive-s"),
    _S("QWEN_TRT_MAX_BODY_MB", "float", 16.0,
       "largest request body in MiB; larger ones get 413 (as deploy/nginx.conf)",
       flag="--max-body-mb"),
    _S("QWEN_TRT_HEADER_TIMEOUT_S", "float", 10.0,
       "seconds a client has to send a request's headers", flag="--header-timeout-s"),
    _S("QWEN_TRT_BODY_TIMEOUT_S", "float", 30.0,
       "seconds a client has to send a request's body after its headers",
       flag="--body-timeout-s"),
    _S("QWEN_TRT_SHUTDOWN_GRACE_S", "float", 10.0,
       "on SIGTERM/SIGINT, seconds in-flight requests get before they end with an error",
       flag="--shutdown-grace-s"),
    _S("QWEN_TRT_ALLOWED_ORIGINS", "str", None,
       "comma-separated browser origins allowed to call the API directly (CORS; none by default)",
       flag="--allowed-origins"),
    _S("QWEN_TRT_ACCESS_LOG", "bool", True,
       "one stderr line per request: method, path, status, duration, request id",
       flag="--no-access-log"),
    _S("QWEN_TRT_KV_EVENTS", "str", None,
       "publish KV-cache events (vLLM's ZMQ/msgpack format) on this endpoint, e.g. "
       "tcp://127.0.0.1:5557 (connects; tcp://*:5557 or ipc://... binds)",
       flag="--kv-events"),
    _S("QWEN_TRT_KV_EVENTS_TOPIC", "str", "",
       "the ZMQ topic of the KV-cache events (llm-d: kv@<pod-ip>@<model>)",
       flag="--kv-events-topic"),
    _S("QWEN_TRT_TRACE_HOPS", "bool", False,
       "qwen-trt serve: time each hop of a request, summed at GET /debug/hops", group="test"),
    # -- build and container ----------------------------------------------------------------------
    _S("QWEN_TRT_ENGINES_DIR", "path", "engines", "where engines are built and looked up",
       group="build", flag="--engines-dir"),
    _S("QWEN_TRT_PROFILES_DIR", "path", None, "build profiles folder (default build/profiles)",
       group="build"),
    _S("QWEN_TRT_IMAGE", "str", None, "the container image the build runs in (docker build path)",
       group="build"),
    _S("QWEN_TRT_BIND", "str", None, "address the container's app binds (docker/compose.yaml)",
       group="build"),
    # -- the app ----------------------------------------------------------------------------------
    _S("QWEN_TRT_APP_SEED_DIR", "path", None,
       "folder of saved chats the app starts from (tests and the UI benchmark)", group="app"),
    # -- fast-path kernel switches (qwen_trt.fast.options; read once, when the kernels are set up)
    _S("QWEN_TRT_PDL", "bool", True,
       "programmatic dependent launch between the decode kernels (0 to bisect a suspected race)",
       group="kernel"),
    _S("QWEN_TRT_CHAIN", "bool", True,
       "chained greedy decode steps in the batched runner (0: every step syncs on the host)",
       group="kernel"),
    _S("QWEN_TRT_STEP_COMPILE", "bool", True,
       "fused kernels for the batched step's norms/activation pieces (0: plain PyTorch ops, "
       "to debug)",
       group="kernel"),
    _S("QWEN_TRT_STEP_TRITON", "bool", True,
       "the batched step's norms/activation pieces as Triton kernels (no torch.compile, no "
       "dynamo import at start; batched._pre_triton / _post_triton; 0: compiled by "
       "torch.compile, or QWEN_TRT_STEP_COMPILE's plain ops)", group="kernel"),
    _S("QWEN_TRT_FP8_PREFILL", "str", "auto",
       "FP8 weights' prefill: auto (tensorcore on Hopper when its load-time check passes, "
       "else dequant) | dequant (then bf16 GEMMs) | tensorcore (activations in FP8 per 128 "
       "columns, cuBLAS's block-scaled FP8 GEMM; Hopper, checked at load, else an error)",
       group="kernel", choices=("auto", "dequant", "tensorcore")),
    _S("QWEN_TRT_FP8_TENSOR_CORES", "bool", True,
       "0: act as if the GPU had no FP8 tensor cores (tests the W8A16 fallback anywhere)",
       group="kernel"),
    _S("QWEN_TRT_SELF_CHECKS", "str", "auto",
       "fast path kernel self-checks: auto (skipped when the warm compile cache recorded them "
       "passing for these weights) | always (every start)", group="kernel",
       choices=("auto", "always")),
    _S("QWEN_TRT_ATTN_SPLIT", "int", None,
       "keys per split of the batch-1 RoPE attention (default 64; for sweeps)", group="kernel"),
    _S("QWEN_TRT_PAGED_SPLIT", "int", None,
       "keys per split of the paged RoPE attention (default 64 for one row, else 128; sweeps)",
       group="kernel"),
    _S("QWEN_TRT_GEMV_", "str", None,
       "QWEN_TRT_GEMV_<N>x<K>=block_n:warps:ctas_per_sm: one GEMV shape's config (sweeps)",
       group="kernel", pattern=True),
    # -- tests and tools --------------------------------------------------------------------------
    _S("QWEN_TRT_TRITON_PATH", "path", None,
       "a Triton copy for the kernel interpreter tests (make test-kernels)", group="test"),
    _S("QWEN_TRT_QWEN_VOCAB_GGUF", "path", None,
       "llama.cpp's ggml-vocab-qwen2.gguf, for the real-vocabulary tokenizer test", group="test"),
    _S("QWEN_TRT_PROPERTY_EXAMPLES", "int", 400,
       "examples per property test of the Markdown sanitiser", group="test"),
    _S("QWEN_TRT_CORPUS", "path", None,
       "extra Markdown payload files for the browser sanitiser test", group="test"),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def declared(name: str) -> Setting:
    """The declaration of ``name`` (a pattern setting matches by prefix); KeyError if none."""
    if name in BY_NAME:
        return BY_NAME[name]
    for s in SETTINGS:
        if s.pattern and name.startswith(s.name):
            return s
    raise KeyError(f"{name} is not a declared qwen-trt setting (qwen_trt/settings.py)")


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's text, stripped; None when unset or empty. ``name`` must be declared."""
    declared(name)
    env = os.environ if environ is None else environ
    val = env.get(name)
    val = val.strip() if isinstance(val, str) else val
    return val or None


def get(name: str, environ: Mapping[str, str] | None = None):
    """The parsed value of ``name``, or its declared default."""
    s = declared(name)
    val = raw(name, environ)
    return s.default if val is None else s.parse(val)


def prefixed(prefix: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of a declared pattern (``prefix``, e.g. ``QWEN_TRT_GEMV_``) set in
    ``environ``, by the rest of their names: their stripped, non-empty values."""
    if not declared(prefix).pattern:
        raise KeyError(f"{prefix} is not a declared pattern (qwen_trt/settings.py)")
    env = os.environ if environ is None else environ
    return {name[len(prefix):]: val.strip() for name, val in env.items()
            if name.startswith(prefix) and isinstance(val, str) and val.strip()}


def unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """``QWEN_TRT_*`` names set in ``environ`` that no declaration knows."""
    env = os.environ if environ is None else environ
    out = []
    for name in sorted(env):
        if name.startswith(PREFIX):
            try:
                declared(name)
            except KeyError:
                out.append(name)
    return out


_warned: set[str] = set()


def warn_unknown(environ: Mapping[str, str] | None = None, stream=None) -> list[str]:
    """Print one line naming the unknown ``QWEN_TRT_*`` variables (once per name a process)."""
    names = [n for n in unknown(environ) if n not in _warned]
    if names:
        _warned.update(names)
        print(f"warning: unknown qwen-trt setting{'s' if len(names) > 1 else ''} ignored: "
              f"{', '.join(names)} (the known ones: qwen_trt/settings.py, README "
              f"'Configuration')", file=stream or sys.stderr)
    return names
