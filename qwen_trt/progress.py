"""Stage progress lines, the same for every multi-stage command (engine build, ONNX export):

    [2/4] export   convert the checkpoint ...
    [2/4] export   12.1 GB written; done in 12.3 s

on stderr or any writer; ``timings`` keeps each stage's seconds (for the manifest)."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class StageLog:
    """Numbered stage lines; :meth:`run` times one stage."""

    def __init__(self, total: int, write: Callable[[str], None] | None = None) -> None:
        self.total = total
        self.n = 0
        self._write = write or (lambda s: print(s, file=sys.stderr, flush=True))
        self.timings: dict[str, float] = {}

    def line(self, text: str) -> None:
        """A detail line under the current stage."""
        self._write(text)

    def run(self, name: str, what: str, fn: Callable[[], T], *, skip: bool = False,
            detail: Callable[[T], str] | None = None) -> T | None:
        """Run stage ``name`` (``what`` says what it does); ``detail(result)`` is shown on its
        done line. ``skip``: say so and run nothing."""
        self.n += 1
        head = f"[{self.n}/{self.total}] {name:<8}"
        if skip:
            self._write(f"{head} {what}: skipped (inputs unchanged; --force rebuilds)")
            self.timings[name] = 0.0
            return None
        self._write(f"{head} {what} ...")
        t = time.perf_counter()
        result = fn()
        dt = time.perf_counter() - t
        self.timings[name] = round(dt, 3)
        note = detail(result) if detail is not None else ""
        self._write(f"{head} {note + '; ' if note else ''}done in {dt:.1f} s")
        return result


class StageClock:
    """Seconds per named part of one timed stage, in the order they ran (the engine's start:
    where the load's seconds go, for its "ready in" line). :meth:`mark` closes the part that
    ran since the previous mark (or since the clock started); marking a name twice adds up.
    Costs one ``perf_counter`` call per mark, so it stays on in production."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, name: str) -> float:
        """Close part ``name``; returns its seconds."""
        now = time.perf_counter()
        dt = now - self._t
        self._t = now
        self.parts[name] = round(self.parts.get(name, 0.0) + dt, 3)
        return dt

    def add(self, name: str, seconds: float) -> None:
        """Record a part timed elsewhere (it does not move the clock)."""
        self.parts[name] = round(self.parts.get(name, 0.0) + seconds, 3)
