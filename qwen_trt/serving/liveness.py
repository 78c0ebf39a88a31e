"""Is the engine process still making progress? Heartbeats from the worker, a watchdog in the client.

Progress is a step's events (new tokens, finished requests) and, while one step runs long (a
long prefill on the serial path), a ``("beat",)`` every :func:`beat_interval` seconds from
:class:`Heartbeat`'s thread; stats alone are not (a runner that polls an executor that is stuck
sends them on empty steps). A process
that is stopped (SIGSTOP), frozen or stuck holding the interpreter sends nothing; the client's
:class:`Watchdog` then sees no progress for ``--watchdog-s`` seconds while requests are in the
engine, and the client kills the process and restarts it like a crash.

When it died (a crash, or the watchdog's kill), :class:`RestartPolicy` says when the client
starts it again: at once, then backing off while starts keep failing (QWEN_TRT_RESTART_KEEP
and the backoff settings).

A step blocked in native code that has let go of the interpreter (a GPU kernel that never
ends, a library call that runs away) would beat for ever, so the heartbeat stops once one step
has run ``QWEN_TRT_MAX_STEP_S`` (default 120 s, :func:`max_step_s`): a step stuck in anything
is noticed ``--watchdog-s`` after that.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from qwen_trt.errors import ConfigError

MAX_BEAT_S = 1.0


def max_step_s(environ=None) -> float:
    """``QWEN_TRT_MAX_STEP_S``, checked: seconds >= 0 (0: a step may beat for ever)."""
    from qwen_trt import settings

    value = settings.get("QWEN_TRT_MAX_STEP_S", environ)
    if not value >= 0 or value == float("inf"):
        raise settings.SettingError(f"QWEN_TRT_MAX_STEP_S must be a number of seconds >= 0 "
                                    f"(0 = no limit), got {value!r}")
    return value


def beat_interval(watchdog_s: float) -> float:
    """How often the worker beats during a long step: a quarter of the watchdog's limit, at most
    a second (0 when the watchdog is off: no beats)."""
    return min(MAX_BEAT_S, watchdog_s / 4) if watchdog_s > 0 else 0.0


class LockedConn:
    """A connection two threads may send on (the serving loop and the heartbeat)."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, msg) -> None:
        with self._lock:
            self._conn.send(msg)

    def recv(self):
        return self._conn.recv()

    def poll(self, timeout: float = 0.0) -> bool:
        return self._conn.poll(timeout)

    def close(self) -> None:
        self._conn.close()


class Heartbeat:
    """Worker side: while a step runs (``with beat.step():``), a daemon thread sends
    ``("beat",)`` on ``conn`` every ``every_s`` seconds, until the step has run ``max_step_s``
    (0: no limit)."""

    def __init__(self, conn, every_s: float, max_step_s: float = 0.0) -> None:
        self._conn = conn
        self.every_s = every_s
        self.max_step_s = max_step_s
        self._stepping = threading.Event()
        self._since = 0.0                 # when the step running now began
        threading.Thread(target=self._run, daemon=True, name="qwen-trt-heartbeat").start()

    @contextlib.contextmanager
    def step(self):
        self._since = time.monotonic()
        self._stepping.set()
        try:
            yield
        finally:
            self._stepping.clear()

    def _run(self) -> None:
        while True:
            self._stepping.wait()
            time.sleep(self.every_s)
            if not self._stepping.is_set():
                continue
            if self.max_step_s and time.monotonic() - self._since > self.max_step_s:
                continue                   # stuck: let the watchdog see the silence
            try:
                self._conn.send(("beat",))
            except (OSError, ValueError, EOFError):
                return                     # the parent is gone; the serving loop sees it too


class Watchdog:
    """Client side: every ``limit_s / 4`` (at most a second) asks ``stalled()`` how long the
    engine has gone without progress (None: nothing to wait for: idle, loading, restarting) and
    calls ``fire()`` once that exceeds ``limit_s``. Holds its owner weakly (``stalled`` and
    ``fire`` are bound methods), so a forgotten client is still collected."""

    def __init__(self, limit_s: float, stalled: Callable[[], float | None],
                 fire: Callable[[], None], name: str = "qwen-trt-watchdog") -> None:
        self.limit_s = limit_s
        self._stalled = weakref.WeakMethod(stalled)
        self._fire = weakref.WeakMethod(fire)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        tick = min(MAX_BEAT_S, self.limit_s / 4)
        while not self._stop.wait(tick):
            stalled = self._stalled()
            if stalled is None:
                return                     # the owner was collected
            quiet = stalled()
            del stalled
            if quiet is not None and quiet > self.limit_s:
                fire = self._fire()
                if fire is None:
                    return
                fire()
                del fire


@dataclass(frozen=True)
class RestartPolicy:
    """When the client starts the engine process again after it died (module docstring of
    :mod:`qwen_trt.serving.client`): at once after a crash of an engine that was up, then,
    while starts keep failing (a crash during the load, or within ``backoff_max_s`` of being
    ready), after ``backoff_s``, ``2 * backoff_s``, ... up to ``backoff_max_s``. Queued
    requests wait through ``keep`` failed starts in a row; after that they (and new ones) are
    refused with a retryable error until a start succeeds."""

    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    keep: int = 3

    def __post_init__(self) -> None:
        if not (math.isfinite(self.backoff_s) and self.backoff_s >= 0):
            raise ConfigError(f"QWEN_TRT_RESTART_BACKOFF_S must be 0 or more, got "
                              f"{self.backoff_s!r}.")
        if not (math.isfinite(self.backoff_max_s) and self.backoff_max_s >= self.backoff_s):
            raise ConfigError(f"QWEN_TRT_RESTART_BACKOFF_MAX_S must be at least "
                              f"QWEN_TRT_RESTART_BACKOFF_S ({self.backoff_s:g}), got "
                              f"{self.backoff_max_s!r}.")
        if self.keep < 1:
            raise ConfigError(f"QWEN_TRT_RESTART_KEEP must be 1 or more, got {self.keep!r}.")

    @classmethod
    def from_settings(cls, environ=None) -> "RestartPolicy":
        from qwen_trt import settings

        try:
            return cls(settings.get("QWEN_TRT_RESTART_BACKOFF_S", environ),
                       settings.get("QWEN_TRT_RESTART_BACKOFF_MAX_S", environ),
                       settings.get("QWEN_TRT_RESTART_KEEP", environ))
        except settings.SettingError as e:
            raise ConfigError(str(e)) from None

    def delay_s(self, failures: int) -> float:
        """The wait before the next start after ``failures`` failed starts in a row (the
        first crash of an engine that was up counts as one: no wait)."""
        if failures <= 1:
            return 0.0
        return min(self.backoff_max_s, self.backoff_s * 2 ** (failures - 2))
