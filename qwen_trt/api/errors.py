"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from dataclasses import dataclass

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         408: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
         503: "service_unavailable"}
EXCERPT_CHARS = 60          # what of a client's value an error message quotes
MAX_MESSAGE_CHARS = 500     # an error message never grows past this


def excerpt(value, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters (a client's value, quoted in a message)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):    # a deeply nested value, an int too long to print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 1] + "…"


@dataclass
class ApiError(Exception):
    """An HTTP error with one clear line; ``headers`` go out with it (Retry-After, ...)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return error_body(self.message, self.status, param=self.param, code=self.code)


def _text(s: str | None, limit: int) -> str | None:
    """Valid UTF-8 (lone surrogates spelled out) of at most ``limit`` characters."""
    if s is None:
        return None
    s = s.encode("utf-8", "backslashreplace").decode("utf-8")
    return s if len(s) <= limit else s[:limit - 1] + "…"


def error_body(message: str, status: int, *, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": _text(message, MAX_MESSAGE_CHARS),
                      "type": TYPES.get(status, "invalid_request_error"),
                      "param": _text(param, 100), "code": code}}
