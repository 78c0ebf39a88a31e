"""Where a request's time goes inside ``qwen-trt serve`` (off unless ``QWEN_TRT_TRACE_HOPS=1``).

Per request, on the API process's clock (``time.perf_counter``):

* ``parse``: body read -> JSON parsed and checked;  ``encode``: -> prompt ids (template +
  tokenizer);  ``submit``: -> handed to the engine service;
* ``bridge``: each event, emitted on the engine thread -> on the event loop (the
  :mod:`qwen_trt.serving.async_events` hop);  ``frame``: on the loop -> SSE chunk ready (stop
  scan, JSON);
* ``first_chunk``: body read -> first content chunk ready (the server side of TTFT).

``GET /debug/hops`` (only when tracing) returns medians and p90s in microseconds.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from qwen_trt import settings
from qwen_trt.stats import percentile

ENV_TRACE = "QWEN_TRT_TRACE_HOPS"
KEEP = 20000          # samples per hop kept (the newest)


@dataclass
class RequestTrace:
    t_in: float
    t_parsed: float
    t_encoded: float
    t_submitted: float
    prompt_tokens: int
    arrived: float = 0.0                       # the latest events reached the loop
    bridge: list[tuple[float, float]] = field(default_factory=list)   # (emitted, on the loop)
    frames: list[float] = field(default_factory=list)                 # on the loop -> chunk
    first_chunk: float | None = None

    def framed(self, now: float) -> None:
        if self.first_chunk is None:
            self.first_chunk = now
        if self.arrived:
            self.frames.append(now - self.arrived)


class HopClock:
    """Collects :class:`RequestTrace` s (thread-safe) and summarises them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hops: dict[str, deque] = {k: deque(maxlen=KEEP) for k in (
            "parse", "encode", "submit", "bridge", "frame", "first_chunk")}
        self.requests = 0

    @classmethod
    def from_env(cls, environ=None) -> "HopClock | None":
        return cls() if settings.get(ENV_TRACE, environ) else None

    def add(self, t: RequestTrace) -> None:
        with self._lock:
            self.requests += 1
            h = self._hops
            h["parse"].append(t.t_parsed - t.t_in)
            h["encode"].append(t.t_encoded - t.t_parsed)
            h["submit"].append(t.t_submitted - t.t_encoded)
            h["bridge"].extend(b - a for a, b in t.bridge)
            h["frame"].extend(t.frames)
            if t.first_chunk is not None:
                h["first_chunk"].append(t.first_chunk - t.t_in)

    def summary(self) -> dict:
        with self._lock:
            out: dict = {"requests": self.requests}
            for k, v in self._hops.items():
                vals = [x * 1e6 for x in v]
                out[k] = {"n": len(vals),
                          "p50_us": round(percentile(vals, 50), 1) if vals else None,
                          "p90_us": round(percentile(vals, 90), 1) if vals else None}
            return out
