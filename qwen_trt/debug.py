"""Debug output: tracebacks are shown only when asked for (``qwen-trt --debug`` or
``QWEN_TRT_DEBUG=1``). Without it every failure is one line; the engine process, started with
this process's environment, follows the same setting."""
from __future__ import annotations

import os

from qwen_trt import settings

DEBUG_ENV = "QWEN_TRT_DEBUG"


def debug_enabled(environ=None) -> bool:
    """Whether tracebacks are wanted (``QWEN_TRT_DEBUG`` read by :func:`settings.parse_bool`;
    a value that is no on/off word counts as off here: this runs while reporting an error)."""
    try:
        return settings.get(DEBUG_ENV, environ)
    except settings.SettingError:
        return False


def enable_debug() -> None:
    """Turn debug output on for this process and the engine processes it starts."""
    os.environ[DEBUG_ENV] = "1"
