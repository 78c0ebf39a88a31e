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
