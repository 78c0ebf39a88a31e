"""Debug output: tracebacks are shown only when asked for (``qwen-trt --debug`` or
``QWEN_TRT_DEBUG=1``). Without it every failure is one line; the engine process, started with
this process's environment, follows the same setting."""
from __future__ import annotations

import os

DEBUG_ENV = "QWEN_TRT_DEBUG"
_TRUE = ("1", "true", "yes", "on")


def debug_enabled(environ=None) -> bool:
    """Whether tracebacks are wanted (``QWEN_TRT_DEBUG`` set to 1 / true / yes / on)."""
    env = os.environ if environ is None else environ
    return (env.get(DEBUG_ENV) or "").strip().lower() in _TRUE


def enable_debug() -> None:
    """Turn debug output on for this process and the engine processes it starts."""
    os.environ[DEBUG_ENV] = "1"
