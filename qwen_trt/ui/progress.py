"""Model-load progress for the browser: the same bars the terminal shows, as events.

Loading runs in a background thread (:class:`BackgroundLoad`), so a page can draw progress while
it waits. What the page draws is a list of :class:`ProgressEvent` ``(stage, fraction, detail)``:

* one for the load as a whole (elapsed time; the stages a loader reports through ``report``);
* one per live ``tqdm`` bar, which is what the terminal shows: huggingface_hub's download bars
  (bytes), transformers' weight-loading bar, the fast path's compile + CUDA-graph capture bar.
  They are read from ``tqdm``'s own registry of live bars, so nothing in the loaders changes.

A loader that knows its stages better (a worker process reporting ``status()``) can feed
``report(stage, fraction, detail)`` instead; the page draws whatever the list holds.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class ProgressEvent:
    stage: str                   # what is happening ("Downloading model.safetensors", ...)
    fraction: float | None       # 0..1, or None when the total is unknown
    detail: str = ""             # "1.2 GB of 8.0 GB", "3/11 graph", ...


def _size(n: float, unit: str) -> str:
    if unit == "B":
        for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if n >= scale:
                return f"{n / scale:.1f} {name}"
        return f"{n:.0f} B"
    return f"{n:g}"


def tqdm_events() -> list[ProgressEvent]:
    """The live tqdm bars of this process, oldest first."""
    try:
        from tqdm import tqdm
    except ImportError:   # pragma: no cover - a dependency
        return []
    try:
        bars = sorted(list(getattr(tqdm, "_instances", ())), key=lambda b: getattr(b, "pos", 0))
    except (RuntimeError, TypeError):   # the set changed while copied: try again next poll
        return []
    out = []
    for bar in bars:
        if getattr(bar, "disable", False):
            continue
        n, total = float(getattr(bar, "n", 0) or 0), getattr(bar, "total", None)
        unit = getattr(bar, "unit", "it") or "it"
        stage = (getattr(bar, "desc", "") or "working").rstrip(": ")
        if total:
            frac = max(0.0, min(1.0, n / float(total)))
            detail = f"{_size(n, unit)} of {_size(float(total), unit)}"
            if unit != "B":
                detail += f" {unit}"
        else:
            frac, detail = None, f"{_size(n, unit)} {unit if unit != 'B' else ''}".strip()
        out.append(ProgressEvent(stage, frac, detail))
    return out


class BackgroundLoad(Generic[T]):
    """Run ``load(report)`` in a thread; poll :meth:`events` and :meth:`wait` from the page.

    ``report(stage, fraction=None, detail="")`` lets the loader name its current stage."""

    def __init__(self, load: Callable[[Callable[..., None]], T], name: str = "qwen-trt-load",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._stage = ProgressEvent("Loading the model", None, "")
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._run, args=(load,), name=name, daemon=True)
        self._thread.start()

    def report(self, stage: str, fraction: float | None = None, detail: str = "") -> None:
        with self._lock:
            self._stage = ProgressEvent(stage, fraction, detail)

    def _run(self, load) -> None:
        try:
            self._result = load(self.report)
        except BaseException as e:  # noqa: BLE001 - handed to the page thread by result()
            self._error = e
        finally:
            self.seconds = self._clock() - self._started
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def failed(self) -> bool:
        return self._done.is_set() and self._error is not None

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def events(self) -> list[ProgressEvent]:
        """The overall stage (with the time so far), then every live progress bar."""
        with self._lock:
            head = self._stage
        elapsed = self._clock() - self._started
        detail = f"{head.detail} · {elapsed:.0f} s" if head.detail else f"{elapsed:.0f} s"
        return [ProgressEvent(head.stage, head.fraction, detail)] + tqdm_events()

    def result(self) -> T:
        """The loaded object (waits); re-raises the loader's error."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


class StageWriter:
    """A text stream whose lines become the load's stage: hand it to a loader that prints its
    progress lines (``echo=``/``file=``), and the page shows each line as it comes."""

    def __init__(self, report: Callable[..., None], prefix: str = "", also=None) -> None:
        self._report = report
        self._prefix = prefix
        self._also = also          # e.g. sys.stderr: the terminal keeps its lines
        self._buf = ""

    def write(self, text: str) -> int:
        if self._also is not None:
            try:
                self._also.write(text)
                self._also.flush()
            except (OSError, ValueError):
                pass
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            line = line.strip()
            if line.startswith(self._prefix):
                line = line[len(self._prefix):].strip()
            if line:
                self._report(line)
        return len(text)

    def flush(self) -> None:
        pass
