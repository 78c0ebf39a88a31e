"""``qwen-trt serve`` listens from the start: the port is bound before the model has loaded.

Until the engine is ready, :class:`LoadingGate` (the ASGI app uvicorn runs) answers
``/health`` with 503 and the engine's state (``{"status": "loading", "reason": <the load's
current stage>, ...}``, :mod:`qwen_trt.api.health`) and every other path with a retryable 503
(``Retry-After``). A thread waits for the engine (``service.wait_ready()``), builds the real
app and hands every later request to it; the same ``/health`` then answers for the app. A load
that fails stops the server, and :func:`serve_while_loading` raises its one line (the command
exits non-zero). SIGTERM while loading stops the server and the load alike.
"""
from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable

from qwen_trt.api.errors import error_body
from qwen_trt.api.health import health_of

log = logging.getLogger("qwen_trt.api")


class _NoAdmission:
    """The shutdown's view of requests in flight before the app exists: none."""

    closing = False

    def in_flight(self) -> int:
        return 0

    def cancel_all(self) -> int:
        return 0


class LoadingGate:
    """ASGI app: 503s while ``service`` loads, then the app ``build()`` makes (module
    docstring). ``on_ready(app)`` / ``on_error(exc)`` are called from the waiting thread."""

    def __init__(self, service, build: Callable[[], object], retry_after_s: int = 5,
                 on_ready: Callable[[object], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.service = service
        self.app = None
        self.error: BaseException | None = None
        self._build = build
        self._retry_after = str(retry_after_s)
        self._on_ready = on_ready
        self._on_error = on_error
        self._started = False
        self.ready = threading.Event()

    def start(self) -> None:
        """Wait for the engine on a daemon thread (once)."""
        if self._started:
            return
        self._started = True
        threading.Thread(target=self._wait, daemon=True, name="qwen-trt-api-ready").start()

    def _wait(self) -> None:
        try:
            wait_ready = getattr(self.service, "wait_ready", None)
            if wait_ready is not None:
                wait_ready()
            if getattr(self.service, "closed", False):
                return                          # shut down while loading
            app = self._build()
        except BaseException as e:  # noqa: BLE001 - reported by the caller, in one line
            self.error = e
            if self._on_error is not None:
                self._on_error(e)
            return
        self.app = app
        self.ready.set()
        if self._on_ready is not None:
            self._on_ready(app)

    async def __call__(self, scope, receive, send) -> None:
        app = self.app
        if app is not None and scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return                              # a websocket: nothing served here
        if scope.get("path") == "/health":
            code, body = health_of(self.service)
            headers = []
        else:
            _, health = health_of(self.service)
            code = 503
            body = error_body(f"The engine is not ready yet ({health.get('status')}: "
                              f"{health.get('reason') or 'starting'}); retry shortly.", 503)
            headers = [(b"retry-after", self._retry_after.encode())]
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode()), *headers]})
        await send({"type": "http.response.body", "body": data})

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.start()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


def serve_while_loading(service, build: Callable[[], object], settings, *,
                        log_level: str = "info") -> None:
    """Bind and serve at once (module docstring) until SIGTERM/SIGINT; raise the load's
    error if the engine could not load."""
    from qwen_trt.api.shutdown import GracefulServer, uvicorn_config

    holder: dict = {}

    def ready(app) -> None:
        server = holder["server"]
        server.admission = app.state.admission
        info = getattr(service, "info", None)
        if info is not None:
            print(f"serving {info.describe()}", file=sys.stderr, flush=True)

    def failed(_e: BaseException) -> None:
        holder["server"].should_exit = True

    gate = LoadingGate(service, build, retry_after_s=settings.retry_after_s,
                       on_ready=ready, on_error=failed)
    server = GracefulServer(uvicorn_config(gate, settings, log_level=log_level),
                            _NoAdmission(), settings.shutdown_grace_s)
    holder["server"] = server
    server.run()
    if gate.error is not None:
        raise gate.error
