"""User-facing errors: each carries one line that says what went wrong and what to do.

The CLI prints ``str(err)`` and exits non-zero; the app shows it in the page. Nothing above
the backends should ever show a traceback for these.
"""
from __future__ import annotations


class QwenTrtError(Exception):
    """Base class: a problem the user can fix. The message says how."""

    exit_code = 2


class ModelSourceError(QwenTrtError):
    """The model folder or hub id cannot be used (missing, not Qwen3, unreachable)."""


class PromptTooLongError(QwenTrtError):
    """The newest message alone does not fit the backend's input limit."""


class EmptyMessageError(QwenTrtError):
    """The user sent an empty (or whitespace-only) message."""


class BackendUnavailableError(QwenTrtError):
    """A backend cannot run here (library missing, no GPU, no engine for this GPU)."""


class EngineMismatchError(QwenTrtError):
    """An engine exists but was built for another GPU or library version."""


class ConfigError(QwenTrtError, ValueError):
    """A setting has a value that cannot work (unknown backend, device, ...)."""


class InvalidMessageError(QwenTrtError, ValueError):
    """A chat message cannot be encoded (not text, or a role the chat template does not take)."""


class FileProblemError(QwenTrtError):
    """A file or folder cannot be used: missing, unreadable, unwritable, not empty, corrupt or
    of the wrong shape. The message names the file and what is wrong with it."""


def first_line(error: BaseException | str, limit: int = 300) -> str:
    """The first line of an error's message (or of a text), stripped and at most ``limit``
    characters; "" when there is none. The one way a traceback-free line is cut from an
    exception anywhere in the project."""
    text = error if isinstance(error, str) else str(error)
    lines = text.strip().splitlines()
    return lines[0].strip()[:limit] if lines else ""


def error_detail(error: BaseException) -> str:
    """``Type: first line of the message`` (the type alone when the message is empty)."""
    first = first_line(error)
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
