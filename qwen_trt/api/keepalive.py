"""SSE comment heartbeats: a stream that stays silent (a client queued behind others, a long
prefill) gets ``: keep-alive`` lines, which every SSE client ignores, so proxies and load
balancers with an idle timeout do not cut it.

The stream keeps its own clock (:class:`KeepAlive`) and learns that time passed from the
request's own heartbeats (its event reader wakes every :attr:`KeepAlive.beat_s` while nothing
arrives), so a chunk costs no extra task or timer.
"""
from __future__ import annotations

import time

KEEPALIVE = ": keep-alive\n\n"
DEFAULT_KEEPALIVE_S = 10.0
MAX_BEAT_S = 0.25         # how late a keep-alive may come at most


class KeepAlive:
    """When a stream owes its client a keep-alive: ``every_s`` seconds since it last sent
    anything (never with ``every_s`` 0)."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s if every_s and every_s > 0 else 0.0
        self.beat_s = min(MAX_BEAT_S, self.every_s) if self.every_s else None
        self.last = time.monotonic()

    def sent(self) -> None:
        self.last = time.monotonic()

    def due(self) -> bool:
        return bool(self.every_s) and time.monotonic() - self.last >= self.every_s
