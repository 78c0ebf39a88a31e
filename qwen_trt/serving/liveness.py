"""Is the engine process still making progress? Heartbeats from the worker, a watchdog in the client.

Progress is a step's events (new tokens, finished requests) and, while one step runs long (a
long prefill on the serial path), a ``("beat",)`` every :func:`beat_interval` seconds from
:class:`Heartbeat`'s thread; stats alone are not (a runner that polls an executor that is stuck
sends them on empty steps). A process
that is stopped (SIGSTOP), frozen or stuck holding the interpreter sends nothing; the client's
:class:`Watchdog` then sees no progress for ``--watchdog-s`` seconds while requests are in the
engine, and the client kills the process and restarts it like a crash.

A step blocked in native code that has let go of the interpreter (a GPU kernel that never
ends, a library call that runs away) would beat for ever, so the heartbeat stops once one step
has run ``QWEN_TRT_MAX_STEP_S`` (default 120 s, :func:`max_step_s`): a step stuck in anything
is noticed ``--watchdog-s`` after that.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable

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
