"""The client of the engine process: the same surface as the in-process ``InferenceService``.

:class:`WorkerClient` starts the worker (:mod:`qwen_trt.serving.worker`, a fresh interpreter),
sends it requests and turns the token ids that come back into text and metrics here, with the
same code as in process (:class:`qwen_trt.serving.generation.ReplyBuilder`). One reader thread blocks on the
pipe (no polling); messages to the worker go through an :class:`~qwen_trt.serving.ipc.Outbox`,
written at once by the calling thread when the pipe takes them without blocking, else by a
sender thread, so no thread ever blocks on the pipe while holding the lock (a full pipe both
ways cannot deadlock: the reader always drains).

* Admission: up to the runner's ``max_concurrency`` requests are in the worker at once; the
  rest wait here in FIFO order and report their position (:class:`Waiting`).
* Cancel: a queued request is dropped; a running one finishes at once with its partial text
  and the worker is told to abort it (its slot frees when the worker confirms).
* Faults: if the worker dies, each request in it ends with one :class:`Failed` line, queued
  ones stay queued, and the next submit (or a queued request) restarts it; ``status().state``
  and ``Waiting.engine`` say "restarting" / "loading" meanwhile. A load that fails is one line.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from qwen_trt.serving.generation import ReplyBuilder
from qwen_trt.errors import first_line, QwenTrtError
from qwen_trt.params import SamplingParams, TokenLogprob
from qwen_trt.serving.session import PromptPlan
from qwen_trt.serving.async_events import batch
from qwen_trt.serving.events import (Delta, RequestFailedError, ModelLoadError, WorkerState,
                                     WorkerStoppedError, Failed, Finished, RequestHandle,
                                     ServiceClosedError, ServiceStatus, Started, cancelled_reply,
                                     queue_position)
from qwen_trt.serving.ipc import Outbox, pair
from qwen_trt.serving.liveness import Watchdog
from qwen_trt.serving.worker import Ready, WorkerSpec, worker_command

log = logging.getLogger(__name__)

_LIVE: "weakref.WeakSet[WorkerClient]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Stop every engine process at exit (before multiprocessing joins its children)."""
    for client in list(_LIVE):
        client.close(timeout=2.0)


@dataclass
class _Active:
    handle: RequestHandle
    builder: ReplyBuilder
    closing: bool = False         # finished on this side; waiting for the worker's final event
    sent: bool = False            # the worker sent tokens for it (its reply has begun)


class _TokenizerPreload:
    """The transformers import, and with a folder the tokenizer itself, on a thread while the
    worker loads (seconds on the real vocabulary, otherwise spent after the worker is ready).
    :meth:`take` gives the tokenizer when the worker names the same folder, else None (then
    it is loaded from what the worker names, as before)."""

    def __init__(self, folder: str | None, name: str) -> None:
        self.folder = folder
        self._tok = None
        self.timings: dict[str, float] = {}   # import_s, load_s, done_s (since the start)
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"{name}-import")
        self._thread.start()

    def _run(self) -> None:
        try:
            from transformers import AutoTokenizer
            self.timings["import_s"] = round(time.monotonic() - self._t0, 3)
            if self.folder is not None:
                t = time.monotonic()
                self._tok = AutoTokenizer.from_pretrained(self.folder)
                self.timings["load_s"] = round(time.monotonic() - t, 3)
        except Exception:  # noqa: BLE001 - reported when the tokenizer is loaded again
            self._tok = None
        self.timings["done_s"] = round(time.monotonic() - self._t0, 3)

    def take(self, source: str):
        if self.folder is None or source != self.folder:
            return None
        self._thread.join()
        return self._tok


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    try:
        proc.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def describe_exit(code: int | None) -> str:
    if code is None:
        return "it stopped answering"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class WorkerClient:
    """Runs the engine ``spec`` names in a child process; blocks until it is ready (a load error
    is raised as one line). Thread-safe."""

    def __init__(self, spec: WorkerSpec, *, echo=None, name: str = "qwen-trt-worker",
                 wait: bool = True, tokenizer_hint: str | None = None) -> None:
        """``wait=False``: return once the worker is started; :meth:`wait_ready` then blocks
        (the caller does its own loading meanwhile: ``qwen-trt serve`` imports the HTTP
        server). ``tokenizer_hint``: the folder the worker will name as its tokenizer's, loaded
        here while the worker loads."""
        self.spec = spec
        self._echo = echo if echo is not None else sys.stderr
        self._name = name
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._waiting: list[RequestHandle] = []
        self._active: dict[int, _Active] = {}
        self._served = self._cached = self._prompt_tokens = self._restarts = 0
        self._runner_stats: dict = {}
        self._state: WorkerState = "loading"
        self._stage = ""
        self._state_since = time.monotonic()
        self._closed = False
        self._gen = 0
        self._conn = None
        self._proc = None
        self._info = None
        self._tokenizer = None
        self._tokenizer_source: str | None = None
        self._max_concurrency = 1
        self._load_error: QwenTrtError | None = None
        self._first = threading.Event()
        self._heard = time.monotonic()     # the latest message from the worker (progress)
        self._hung_gen = 0                 # the worker generation the watchdog stopped
        self._watchdog: Watchdog | None = None
        self._loop = None                  # an attached event loop reads the pipe (attach_loop)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)
        self.timings: dict[str, float] = {}
        self.pid: int | None = None
        _LIVE.add(self)
        # Import the tokenizer library (and read the tokenizer, when its folder is known) while
        # the worker loads: seconds that would otherwise follow the worker's ready.
        self._preload = _TokenizerPreload(tokenizer_hint, name)
        # handles put back in the queue after a crash (at most once each; weakly held)
        self._requeued: weakref.WeakSet = weakref.WeakSet()
        with self._lock:
            self._spawn()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "WorkerClient":
        """Block until the worker is ready (a load error is raised as one line, and the
        worker stopped); then the hang watchdog is armed. Returns self."""
        try:
            self._first.wait()
        except BaseException:            # Ctrl-C while loading: never leave the worker behind
            self.close(timeout=2.0)
            raise
        if self._load_error is not None:
            self.close()
            raise self._load_error
        limit = getattr(self.spec.cfg, "watchdog_s", 0)
        if limit > 0 and self._watchdog is None:   # armed once loaded: a load is no hang
            self._watchdog = Watchdog(limit, self._stalled_s, self._on_hang,
                                      name=f"{self._name}-watchdog")
        return self

    # -- the InferenceService surface ----------------------------------------------------------
    @property
    def info(self):
        return self._info

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def max_concurrency(self) -> int:
        return self._max_concurrency

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               dropped_turns: int = 0) -> RequestHandle:
        """Queue a request and return its handle at once (restarts a stopped engine)."""
        with self._lock:
            if self._closed:
                raise ServiceClosedError("The model service is shutting down: reload the page.")
            handle = RequestHandle(self, next(self._ids), prompt_ids, params, dropped_turns)
            self._waiting.append(handle)
            if self._state in ("stopped", "failed"):
                self._restart()
            self._pump()
        return handle

    def submit_plan(self, plan: PromptPlan, params: SamplingParams) -> RequestHandle:
        return self.submit(plan.ids, params, plan.dropped_turns)

    def status(self) -> ServiceStatus:
        with self._lock:
            return ServiceStatus(
                busy=bool(self._active), queued=len(self._waiting), served=self._served,
                state=self._state, stage=self._stage, running=len(self._active),
                max_concurrency=self._max_concurrency, cached_tokens=self._cached,
                prompt_tokens=self._prompt_tokens, restarts=self._restarts,
                runner=dict(self._runner_stats))

    def close(self, timeout: float = 5.0, *, free_backend: bool = True) -> None:
        """Cancel everything and stop the engine process (it frees the backend itself)."""
        del free_backend   # the process exits: its memory is always freed
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._watchdog is not None:
                self._watchdog.stop()
            self._set_state("closed", "")
            for h in self._waiting:
                h._cancel.set()
                h._emit(Finished(cancelled_reply(h)))
            self._waiting.clear()
            for a in list(self._active.values()):
                a.handle._cancel.set()
                self._finish_here(a, cancelled=True)
            proc = self._proc
            self._send(("stop",))
        _LIVE.discard(self)
        self._first.set()
        if proc is not None:
            if not _wait(proc, timeout):
                log.warning("worker process %s did not stop in %.1f s; killing it", proc.pid,
                            timeout)
                proc.kill()
                _wait(proc, 2.0)

    def attach_loop(self, loop) -> None:
        """Read the engine's messages on ``loop`` (an asyncio loop in this process, e.g. the
        HTTP server's) from now on, instead of on the reader thread: each step's tokens then
        reach that loop without a hand-off between threads. Call it from the loop; until the
        loop is closed (then the reader thread takes over again)."""
        with self._lock:
            if self._loop is loop or self._closed:
                return
            self._loop = loop
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass                             # a wake-up is pending already

    # -- handles call these --------------------------------------------------------------------
    def _position(self, handle: RequestHandle) -> int:
        with self._lock:
            return queue_position(self._waiting, handle, bool(self._active))

    def _cancel(self, handle: RequestHandle) -> None:
        with self._lock:
            if handle in self._waiting:
                self._waiting.remove(handle)
                handle._emit(Finished(cancelled_reply(handle)))
                return
            a = self._active.get(handle.id)
            if a is None or a.closing:
                return
            self._finish_here(a, cancelled=True)
            self._send(("abort", handle.id))

    def _engine_note(self) -> str:
        """A line for the UI while the engine is not ready ("" when it is)."""
        with self._lock:
            state, stage, since = self._state, self._stage, self._state_since
        if state == "ready":
            return ""
        took = f" ({time.monotonic() - since:.0f} s)"
        if state == "restarting":
            return f"Restarting the worker: {stage}{took}"
        if state == "loading":
            return f"Starting the worker: {stage}{took}"
        return stage

    # -- internals (called with the lock held) -------------------------------------------------
    def _set_state(self, state: WorkerState, stage: str) -> None:
        if state != self._state:
            self._state_since = time.monotonic()
        self._state, self._stage = state, stage

    def _send(self, msg) -> None:
        """Write ``msg`` to the worker (never blocks: see :class:`~qwen_trt.serving.ipc.Outbox`)."""
        if self._conn is not None:
            self._outbox.put(msg)

    def _spawn(self) -> None:
        self._gen += 1
        parent, child = pair()
        self._spawned_at = time.monotonic()
        self._set_state("restarting" if self._gen > 1 else "loading",
                        "starting the worker process")
        # A fresh interpreter (CUDA cannot be used in a forked child), started with subprocess
        # rather than multiprocessing's spawn, which re-runs the parent's __main__ in the child:
        # under Streamlit that is app.py itself.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            proc = subprocess.Popen(worker_command(child.fileno()), pass_fds=(child.fileno(),),
                                    stdin=subprocess.DEVNULL, env=env, close_fds=True)
        finally:
            child.close()
        parent.send(("init", self.spec, os.getpid()))
        self._conn, self._proc, self.pid = parent, proc, proc.pid
        self._outbox = Outbox(parent, name=f"{self._name}-sender")
        threading.Thread(target=self._read, args=(self._gen, parent, proc, self._outbox),
                         daemon=True, name=f"{self._name}-reader").start()

    def _restart(self) -> None:
        self._restarts += 1
        self._say(f"restarting the worker process (restart {self._restarts})")
        self._spawn()

    def _pump(self) -> None:
        """Admit queued requests while the worker has free slots."""
        if self._state != "ready" or self._closed:
            return
        if self._waiting and not self._active:
            self._heard = time.monotonic()      # busy from now: the watchdog counts from here
        while self._waiting and len(self._active) < self._max_concurrency:
            h = self._waiting.pop(0)
            if h.cancelled:
                continue
            builder = ReplyBuilder(self._tokenizer, h.params, h.params.stop_ids(self._info.stop_token_ids),
                                   len(h.prompt_ids), h.dropped_turns)
            self._active[h.id] = _Active(h, builder)
            h.state = "running"
            if h not in self._requeued:         # a request put back after a crash started once
                h.started_at = time.monotonic()
                h._emit(Started(waited_s=h.waited_s))
                self._prompt_tokens += len(h.prompt_ids)
            builder.start()
            self._send(("submit", h.id, h.prompt_ids, h.params))

    def _finish_here(self, a: _Active, cancelled: bool) -> None:
        """End the handle now; the slot stays taken until the worker's final event."""
        a.closing = True
        tail = a.builder.finish(cancelled=cancelled)
        if tail or a.builder.pending:
            a.handle._emit(a.builder.delta(tail))
        a.handle._emit(Finished(a.builder.reply))
        self._served += 1

    def _say(self, line: str) -> None:
        try:
            print(f"[qwen-trt engine] {line}", file=self._echo, flush=True)
        except (OSError, ValueError):
            pass

    # -- the reader thread ---------------------------------------------------------------------
    def _read(self, gen: int, conn, proc, outbox: Outbox) -> None:
        """The reader thread of one worker incarnation. Once the worker is ready and an event
        loop is attached (:meth:`attach_loop`), that loop reads the pipe instead (no hand-off
        between threads per step) and this thread only waits for the end."""
        end = {"fatal": None, "load_error": None}
        try:
            while True:
                if self._loop is not None and self._state == "ready" and gen == self._gen \
                        and not conn.has_message():
                    if self._read_on_loop(gen, conn, end):
                        break                # the pipe ended (seen on the loop)
                    continue                 # the loop went away: read here again
                if not conn.has_message():
                    ready, _, _ = select.select([conn.sock, self._wake_r], [], [])
                    if self._wake_r in ready:
                        os.read(self._wake_r, 64)      # a loop was attached: look again
                        if conn.sock not in ready:
                            continue
                if not self._handle_message(gen, conn.recv(), end):
                    break
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 - a bug here must not leave callers hanging
            log.exception("worker client reader failed")
            end["fatal"] = "the worker client lost its connection"
        fatal, load_error = end["fatal"], end["load_error"]
        if load_error is not None and proc.poll() is None:
            proc.kill()
        if not _wait(proc, 10.0):
            proc.kill()
            _wait(proc, 2.0)
        outbox.close()            # the sender closes the pipe
        self._on_exit(gen, proc.returncode, fatal, load_error)

    def _handle_message(self, gen: int, msg, end: dict) -> bool:
        """One message from the worker; False when reading should stop (a failed load)."""
        kind = msg[0]
        if kind == "events":
            if msg[1]:              # tokens or finishes: progress (stats alone are not)
                self._heard = time.monotonic()
            self._on_events(gen, msg[1], msg[2])
        elif kind == "beat":        # a long step still runs (serving.liveness)
            self._heard = time.monotonic()
        elif kind == "stage":
            self._on_stage(gen, msg[1], msg[2])
        elif kind == "ready":
            end["load_error"] = self._on_ready(gen, msg[1])
            if end["load_error"] is not None:
                return False
        elif kind == "load_error":
            end["load_error"] = msg[2] if msg[2] is not None else ModelLoadError(msg[1])
        elif kind == "fatal":
            end["fatal"] = msg[1]
        return True

    def _read_on_loop(self, gen: int, conn, end: dict) -> bool:
        """Have the attached loop read ``conn`` (a reader callback: every message it holds,
        in one pass) until the pipe ends (True) or the loop is closed or stopped (False: this
        thread reads again; it checks once a second)."""
        loop = self._loop
        ended = threading.Event()
        fd = conn.sock.fileno()

        def readable() -> None:
            try:
                for msg in conn.recv_ready():
                    if not self._handle_message(gen, msg, end):
                        raise EOFError
            except (EOFError, OSError):
                loop.remove_reader(fd)
                ended.set()
            except Exception:  # noqa: BLE001 - a bug here must not leave callers hanging
                log.exception("worker client reader failed")
                end["fatal"] = "the worker client lost its connection"
                loop.remove_reader(fd)
                ended.set()

        try:
            loop.call_soon_threadsafe(loop.add_reader, fd, readable)
        except RuntimeError:         # closed meanwhile
            self._detach(loop)
            return False
        idle = 0
        while not ended.wait(1.0):
            idle = 0 if loop.is_running() else idle + 1
            if loop.is_closed() or idle >= 2:      # closed, or stopped for over a second
                if not loop.is_closed():
                    try:
                        loop.remove_reader(fd)     # the loop runs nothing now
                    except Exception:  # noqa: BLE001 - it is being torn down
                        pass
                self._detach(loop)
                return False
        return True

    def _detach(self, loop) -> None:
        with self._lock:
            if self._loop is loop:
                self._loop = None

    def _on_stage(self, gen: int, line: str, t: float) -> None:
        with self._lock:
            if gen != self._gen or self._closed:
                return
            self._stage = line
        self._say(f"{line} ({time.monotonic() - self._spawned_at:.1f} s)")

    def _on_ready(self, gen: int, ready: Ready) -> QwenTrtError | None:
        t = time.monotonic()
        try:
            if self._tokenizer is None or ready.tokenizer_source != self._tokenizer_source:
                tok = self._preload.take(ready.tokenizer_source)
                if tok is None:
                    from transformers import AutoTokenizer

                    tok = AutoTokenizer.from_pretrained(ready.tokenizer_source)
                self._tokenizer, self._tokenizer_source = tok, ready.tokenizer_source
        except Exception as e:  # noqa: BLE001 - one line
            return ModelLoadError(first_line(f"Could not load the tokenizer from "
                                              f"'{ready.tokenizer_source}': {e}"))
        tok_s = time.monotonic() - t
        with self._lock:
            if gen != self._gen or self._closed:
                return None
            self._info = ready.info
            self._max_concurrency = max(1, ready.max_concurrency)
            pre = {f"parent_tokenizer_{k}": v for k, v in self._preload.timings.items()}
            self.timings = {**ready.timings, **pre, "parent_tokenizer_s": round(tok_s, 3),
                            "ready_s": round(time.monotonic() - self._spawned_at, 3)}
            self.pid = ready.pid
            was = self._state
            self._set_state("ready", "")
            self._load_error = None
            self._say(f"{'restarted' if was == 'restarting' else 'ready'} in "
                      f"{self.timings['ready_s']:.1f} s ({ready.info.describe()}; "
                      f"{self._max_concurrency} at once; stages: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in self.timings.items()) + ")")
            self._pump()
        self._first.set()
        return None

    def _on_events(self, gen: int, events, stats) -> None:
        with self._lock, batch():      # one wake-up of each listening event loop per step
            if gen != self._gen:
                return
            if stats:
                self._runner_stats = stats
            freed = False
            for rid, token_ids, finish, error, cached, lps in events:
                a = self._active.get(rid)
                if a is None:
                    continue
                self._cached += cached
                m = a.builder.metrics
                if cached or m.cached_tokens is None:     # the first event carries the count
                    m.cached_tokens = (m.cached_tokens or 0) + cached
                try:
                    self._apply(a, rid, token_ids, finish, error, lps)
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    log.exception("request %s: handling its tokens failed", rid)
                    if not a.closing:
                        a.closing = True
                        a.handle._emit(Failed(RequestFailedError(
                            f"Decoding the reply failed ({type(e).__name__}: {e})"
                            .splitlines()[0])))
                        self._served += 1
                    self._send(("abort", rid))
                if finish is not None:
                    del self._active[rid]
                    freed = True
            if freed:
                self._pump()

    def _apply(self, a: _Active, rid: int, token_ids, finish, error, lps=()) -> None:
        if a.closing:
            return
        b = a.builder
        if token_ids:
            a.sent = True
        text = []
        for i, tok in enumerate(token_ids):
            if b.done:
                break
            d = b.add(tok, TokenLogprob(*lps[i]) if lps else None)
            if d:
                text.append(d)
        if text:
            a.handle._emit(b.delta("".join(text)))
        if finish == "error":
            a.closing = True
            a.handle._emit(Failed(RequestFailedError(error or "The worker failed on this request.")))
            self._served += 1
        elif finish is not None or b.done:
            self._finish_here(a, cancelled=finish == "cancelled" and not b.done)
            if finish is None:               # the runner would go on: free its slot
                self._send(("abort", rid))

    # -- the watchdog (qwen_trt.serving.liveness) --------------------------------------------
    def _stalled_s(self) -> float | None:
        """Seconds without a message from a ready worker that has requests; None otherwise."""
        with self._lock:
            if self._closed or self._state != "ready" or not self._active:
                return None
            return time.monotonic() - self._heard

    def _on_hang(self) -> None:
        """No progress for --watchdog-s: kill the worker; its exit restarts it (_on_exit)."""
        with self._lock:
            quiet = self._stalled_s()
            limit = self._watchdog.limit_s if self._watchdog is not None else 0
            if quiet is None or quiet <= limit or self._proc is None:
                return
            self._hung_gen = self._gen
            self._set_state("restarting", f"the worker made no progress for {quiet:.0f} s")
            self._say(f"no progress for {quiet:.1f} s with {len(self._active)} request(s) in the "
                      f"worker (--watchdog-s {limit:g}): stopping it (pid {self._proc.pid})")
            self._proc.kill()              # SIGKILL: also ends a stopped (SIGSTOP) process

    def _on_exit(self, gen: int, code: int | None, fatal: str | None,
                 load_error: QwenTrtError | None) -> None:
        with self._lock:
            if gen != self._gen:
                return
            self._conn = None
            if self._closed:
                return
            why = fatal or describe_exit(code)
            hung = gen == self._hung_gen
            if hung:
                limit = self._watchdog.limit_s if self._watchdog is not None else 0
                err_line = (f"The worker stopped making progress (nothing for {limit:g} s, "
                            f"--watchdog-s) and is being restarted; your chat is kept — send "
                            f"again.")
            elif load_error is not None or self._state in ("loading", "restarting"):
                err = load_error or ModelLoadError(
                    f"The worker process stopped while loading ({why}); see the server log.")
                self._load_error = err
                self._set_state("failed", str(err))
                self._say(f"load failed: {err}")
                for h in self._waiting:
                    h._emit(Failed(err))
                self._waiting.clear()
                self._first.set()
                return
            else:
                err_line = (f"The worker process stopped ({why}); your chat is kept — send "
                            f"again to restart it.")
            self._say(err_line)
            self._set_state("stopped", err_line)
            # Requests whose reply had not begun go back to the front of the queue, in order,
            # for the restarted worker (nothing of theirs is lost; a client sees only the
            # wait). Once only: a request in flight at a second crash may be its cause.
            again = []
            for a in self._active.values():
                if a.closing:
                    continue
                if not a.sent and a.handle not in self._requeued:
                    self._requeued.add(a.handle)
                    a.handle.state = "queued"
                    again.append(a.handle)
                else:
                    a.handle._emit(Failed(WorkerStoppedError(err_line)))
                    self._served += 1
            self._active.clear()
            self._waiting[:0] = again
            if again:
                self._say(f"{len(again)} request(s) whose reply had not begun wait for the "
                          "restarted worker")
            if self._waiting or hung:      # a hung engine comes back at once (health 503 until)
                self._restart()
