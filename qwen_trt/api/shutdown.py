"""Running the app under uvicorn with our own shutdown.

On SIGTERM or SIGINT the server stops accepting connections (uvicorn closes its listener and
idle keep-alive connections), lets the requests in flight finish for ``shutdown_grace_s``, then
cancels the engine requests still going: each ends in OpenAI's shape (a stream with an error
event then ``data: [DONE]``, a whole reply with a JSON 503), and requests arriving after that
get a 503. A second signal ends them at once. Then the caller closes the service and the
process exits 0 (uvicorn's own handler would re-raise the signal and skip that).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

import uvicorn

from qwen_trt.api.timeouts import timed_protocol

log = logging.getLogger("qwen_trt.api")
SIGNALS = (signal.SIGINT, signal.SIGTERM)
FINISH_S = 5.0      # after the grace: time for the cancelled requests to send their error


def uvicorn_config(app, settings, *, log_level: str = "info", **kw) -> uvicorn.Config:
    """The uvicorn settings ``qwen-trt serve`` runs with (slow-client deadlines included)."""
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                          access_log=False,
                          http=timed_protocol(settings.header_timeout_s, settings.body_timeout_s),
                          timeout_graceful_shutdown=settings.shutdown_grace_s + FINISH_S, **kw)


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the shutdown described in the module docstring."""

    def __init__(self, config: uvicorn.Config, admission, grace_s: float) -> None:
        super().__init__(config)
        self.admission = admission
        self.grace_s = grace_s
        self.signalled = 0
        self._grace: asyncio.TimerHandle | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.begin_shutdown, sig)
        try:
            yield
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)

    def begin_shutdown(self, sig: int | None = None) -> None:
        """Start the shutdown (a second call: end the requests in flight now)."""
        self.signalled += 1
        if self.signalled > 1:
            log.warning("second signal: ending %d request(s) in flight now",
                        self.admission.in_flight())
            self.end_in_flight()
            return
        name = signal.Signals(sig).name if sig else "shutdown"
        log.warning("%s: no new connections; %d request(s) in flight get %g s to finish", name,
                    self.admission.in_flight(), self.grace_s)
        self.should_exit = True
        self._grace = asyncio.get_running_loop().call_later(self.grace_s, self.end_in_flight)

    def end_in_flight(self) -> None:
        self.admission.closing = True
        n = self.admission.cancel_all()
        if n:
            log.warning("ending %d request(s) still in flight (shutting down)", n)

    async def shutdown(self, sockets=None) -> None:
        try:
            await super().shutdown(sockets)
        finally:
            if self._grace is not None:
                self._grace.cancel()


def serve(app, settings, *, log_level: str = "info") -> None:
    """Serve ``app`` until SIGTERM/SIGINT, shutting down as the module docstring says."""
    server = GracefulServer(uvicorn_config(app, settings, log_level=log_level),
                            app.state.admission, settings.shutdown_grace_s)
    server.run()
