"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from dataclasses import dataclass

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         413: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


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


def error_body(message: str, status: int, *, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
