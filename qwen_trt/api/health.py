"""``GET /health``: 200 when the engine takes requests, else 503 saying why.

The body is the same shape in every state (a readiness probe reads the code; a person, the
rest)::

    200 {"status": "ready", "restarts": 0, "kernels": {"attention": "triton", ...}}
    503 {"status": "loading" | "restarting" | "crashing" | "closed" | ...,
         "reason": "...", "restarts": 2, "next_retry_s": 3.9,
         "error": {"message": ..., "type": "service_unavailable", ...}}

``kernels``: the path each kernel family of the fast path runs (:attr:`BackendInfo.kernels`),
when the backend reports them; ``slow_fallbacks``: the families that fell back to a much slower
path, and why (only when ``serve --allow-slow-fallback`` let it start). ``next_retry_s``: while the engine keeps crashing, the
seconds until its next start (``null`` when a start is under way).
"""
from __future__ import annotations

from qwen_trt.api.errors import error_body

def health(status, info=None) -> tuple[int, dict]:
    """(HTTP code, body) for a service's ``status()`` (None: it could not report) and its
    ``info`` (a :class:`~qwen_trt.backends.base.BackendInfo`, or None before the first load)."""
    if status is None:
        return 503, {"status": "unknown", "reason": "the engine does not answer",
                     **error_body("The engine is not running (it does not answer).", 503)}
    state = getattr(status, "state", "ready")
    restarts = int(getattr(status, "restarts", 0) or 0)
    kernels = dict(getattr(info, "kernels", None) or {})
    slow = dict(getattr(info, "slow_kernels", None) or {})
    extra: dict = {}
    if kernels:
        extra["kernels"] = kernels
    if slow:                                # served anyway (serve --allow-slow-fallback)
        extra["slow_fallbacks"] = slow
    if getattr(status, "accepting", state == "ready"):
        return 200, {"status": "ready", "restarts": restarts, **extra}
    reason = getattr(status, "reason", "") or getattr(status, "stage", "") or ""
    body = {"status": state, "reason": reason, "restarts": restarts,
            "next_retry_s": getattr(status, "next_retry_s", None), **extra}
    detail = f"{state}: {reason}" if reason else state
    return 503, {**body, **error_body(f"The engine is not running ({detail}); retry later.",
                                      503)}


def health_of(service) -> tuple[int, dict]:
    """:func:`health` of a service (one that cannot even report is not running)."""
    try:
        status = service.status()
    except Exception:  # noqa: BLE001 - a service that cannot report is not alive
        status = None
    return health(status, getattr(service, "info", None))
