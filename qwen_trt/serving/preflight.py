"""Checks made in this process before the engine process starts: that process imports torch
first (seconds to tens of seconds), so a missing folder or a broken checkpoint is reported at once
instead, with the same one line the engine would give."""
from __future__ import annotations

from pathlib import Path

from qwen_trt.errors import BackendUnavailableError


def preflight(cfg) -> None:
    """Check what ``cfg`` (a :class:`~qwen_trt.backends.BackendConfig`) names on this machine:
    the ``--engine`` folder exists; a ``--model`` that is a local path is a sound checkpoint
    (:func:`~qwen_trt.model.source.resolve_model`: files, config numbers, weight shapes and a
    sample of their values; no torch). A hub id is left to the engine (it may download)."""
    from qwen_trt.model.checks import check_file_kinds
    from qwen_trt.model.source import looks_like_path, resolve_model

    if cfg.backend == "openai":
        return
    if cfg.engine:
        engine = Path(cfg.engine).expanduser()
        if not engine.is_dir():
            raise BackendUnavailableError(
                f"Engine folder '{cfg.engine}' does not exist (--engine / QWEN_TRT_ENGINE): pass "
                f"the folder `make engine` wrote, or leave --engine out.")
    if not cfg.model:
        return
    path = Path(cfg.model).expanduser()
    if not path.exists() and not looks_like_path(cfg.model):
        return                                  # a hub id
    if cfg.engine and path.is_dir():
        check_file_kinds(path)                  # the tokenizer source of a given engine
        return
    resolve_model(cfg.model)
