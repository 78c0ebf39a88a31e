"""The loopback API is not a door for web pages: two checks before any route runs.

* **Content-Type.** A ``POST`` whose ``Content-Type`` is not ``application/json`` gets a 415. A
  web page on another origin may send a "simple" cross-origin request without asking first (no
  CORS preflight) only as ``text/plain``, form data, or with no type at all; with this check none
  of those reaches a route, so a page cannot make a keyless loopback server run its prompt.
* **Host.** A request whose ``Host`` names anything other than a loopback name (``localhost``,
  ``127.0.0.1``, ``[::1]``, with or without a port), the address ``serve`` binds, the address the
  connection came in on, or one of ``--allowed-hosts`` gets a 421: a DNS-rebinding page (its own
  name resolving to 127.0.0.1) sends its own name. ``--allowed-hosts *`` turns the check off.
  A request without ``Host`` (HTTP/1.0, not a browser) passes, and so does ``GET /health``
  (probes and load balancers reach it by any name; it takes no input and says only up or down).

:class:`HostCheck` is the one place the ``Host`` rule lives; :class:`RequestGuard` is the ASGI
middleware that applies both.
"""
from __future__ import annotations

from dataclasses import dataclass

from starlette.responses import JSONResponse

from qwen_trt.api.errors import ApiError, excerpt
from qwen_trt.api.listen import host_name
from qwen_trt.api.server_settings import is_loopback

JSON_TYPE = "application/json"
UNCHECKED_PATHS = frozenset({"/health"})      # answered for any Host (GET only: no body)
_WILDCARDS = frozenset({"0.0.0.0", "::"})


@dataclass(frozen=True)
class HostCheck:
    """Which ``Host`` values the server answers (the module docstring)."""

    bound: str = "127.0.0.1"                 # ServerSettings.host (normalised, no brackets)
    allowed: tuple[str, ...] = ()            # ServerSettings.allowed_hosts (checked there)

    def allows(self, header: str, local: str | None = None) -> bool:
        """Whether a request with ``Host: header`` is answered; ``local``: the address the
        connection came in on (the ASGI scope's ``server`` host)."""
        if "*" in self.allowed:
            return True
        name = host_name(header)
        if name is None:
            return False
        if is_loopback(name) or name in self.allowed:
            return True
        bound = host_name(self.bound)
        if bound not in _WILDCARDS and name == bound:
            return True
        return local is not None and name == host_name(str(local))


def _json_type(value: str | None) -> bool:
    return value is not None and value.split(";", 1)[0].strip().lower() == JSON_TYPE


class RequestGuard:
    """ASGI middleware: the ``Host`` check for every HTTP request, then the ``Content-Type``
    check for every ``POST`` (both before any of the body is read)."""

    def __init__(self, app, hosts: HostCheck) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = ctype = None
        for name, value in scope.get("headers", ()):
            if name == b"host":
                host = value.decode("latin-1")
            elif name == b"content-type":
                ctype = value.decode("latin-1")
        if host is not None and scope.get("path") not in UNCHECKED_PATHS:
            server = scope.get("server")
            if not self.hosts.allows(host, server[0] if server else None):
                return await _refuse(scope, receive, send, ApiError(
                    421, f"This server does not answer for the host {excerpt(host)}: send it "
                         "to 127.0.0.1 / localhost, or start it with --allowed-hosts naming "
                         "that host.", code="misdirected_request"))
        if scope.get("method") == "POST" and not _json_type(ctype) and _takes_post(scope):
            got = "no Content-Type" if ctype is None else f"Content-Type {excerpt(ctype)}"
            return await _refuse(scope, receive, send, ApiError(
                415, f"Send the body as JSON with 'Content-Type: application/json' (got {got}).",
                code="unsupported_media_type"))
        return await self.app(scope, receive, send)


def _takes_post(scope) -> bool:
    """Whether a route takes this POST (else the router answers: 404, or 405 with Allow)."""
    from starlette.routing import Match

    router = getattr(scope.get("app"), "router", None)
    if router is None:
        return True
    return any(route.matches(scope)[0] is Match.FULL for route in router.routes)


async def _refuse(scope, receive, send, e: ApiError) -> None:
    # the body is left unread: the connection closes after the answer
    await JSONResponse(e.body(), status_code=e.status,
                       headers={"Connection": "close"})(scope, receive, send)
