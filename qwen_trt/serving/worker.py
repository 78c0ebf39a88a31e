"""The engine in its own process: load a backend, build its :class:`Runner`, serve steps.

The parent (:class:`qwen_trt.serving.client.WorkerClient`) starts a fresh interpreter
(:func:`worker_command`: CUDA cannot be used after ``fork``, and multiprocessing's ``spawn`` would
re-run the parent's ``__main__``, which under Streamlit is app.py) holding one end of a
socketpair (:mod:`qwen_trt.serving.ipc`, chosen by measurement: ``qwen_trt.bench.ipc``,
docs/benchmarks.md). The first message is ``("init", WorkerSpec, parent_pid)``.

Messages, each a tuple whose first item names it:

parent -> worker   ``("submit", id, prompt_ids, params)``, ``("abort", id)``, ``("stop",)``
worker -> parent   ``("stage", line, seconds_since_start)``   load / warm-up progress
                   ``("ready", Ready)``                       loaded; serving
                   ``("load_error", line, error)``            then the worker exits
                   ``("beat",)``                              a long step is still running (the
                                                              parent's watchdog: serving.liveness)
                   ``("events", [event, ...], stats)``        all events of one step, one message:
                                                              TokenEvents as tuples (:func:`pack`);
                                                              ``stats`` (a dict) at most 4x a second
                   ``("fatal", detail)``                      then the worker exits (a CUDA
                                                              error, a runner bug)

Between steps the worker takes every message that has arrived (``poll(0)``); with nothing to do
it blocks in ``recv``. It exits when the parent closes its end (or dies: a watchdog thread sees
the parent go away even while a long load or step runs).
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field

from qwen_trt.backends import BackendConfig
from qwen_trt.serving.liveness import Heartbeat, LockedConn, beat_interval, max_step_s

DEFAULT_LOADER = "qwen_trt.backends:load_backend"
STATS_EVERY_S = 0.25


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker loads. ``loader`` and ``runner`` are ``"module:function"`` names (so the
    spec pickles for ``spawn``): ``loader(cfg) -> Backend``; ``runner(backend) -> Runner``
    (default :func:`make_runner`). Tests name fakes here."""

    cfg: BackendConfig = field(default_factory=BackendConfig)
    loader: str = DEFAULT_LOADER
    runner: str | None = None
    kv_events: object | None = None     # a serving.kv_events.KvEventsConfig: publish them


@dataclass(frozen=True)
class Ready:
    info: object                    # BackendInfo
    tokenizer_source: str           # folder (or hub id) the parent loads the tokenizer from
    max_concurrency: int
    timings: dict                   # stage -> seconds, in the worker
    pid: int


def make_runner(backend, max_batch: int | None = None, cfg=None):
    """The runner for ``backend``: its own (``backend.make_runner()``: the TensorRT-LLM executor),
    continuous batching over a fast backend's weights (``max_batch`` wide; speculative
    decoding as ``cfg``, a :class:`~qwen_trt.backends.BackendConfig`, says), else, or with
    ``max_batch == 1``, :class:`SerialRunner` (one at a time on the backend's own stream)."""
    own = getattr(backend, "make_runner", None)
    if callable(own):
        return own()
    speculative = cfg is not None and cfg.speculative != "off"
    if hasattr(backend, "take_model") and (max_batch != 1 or speculative):
        # (speculation verifies drafts in the batched runner's steps: at --max-batch 1 too)
        from qwen_trt.serving.scheduler import SchedulerConfig, batch_runner_for
        from qwen_trt.serving.speculation import SpecConfig

        kw = {} if max_batch is None else {"max_batch": max_batch}
        if speculative:
            k = cfg.num_speculative_tokens
            kw["speculative"] = SpecConfig.parse(cfg.speculative, None if k == "auto" else int(k))
        return batch_runner_for(backend, SchedulerConfig(**kw))
    from qwen_trt.serving.serial import SerialRunner

    return SerialRunner(backend)


def load_for_spec(loader, spec: WorkerSpec):
    """``loader(spec.cfg)``; the default loader is told when the batched runner will take the
    fast path over (:func:`make_runner` with ``max_batch`` other than 1), so the batch-1
    decoder's graphs, which the runner drops, are not built first."""
    if spec.loader == DEFAULT_LOADER and spec.runner is None and (
            spec.cfg.max_batch != 1 or spec.cfg.speculative != "off"):
        return loader(spec.cfg, for_runner=True)
    return loader(spec.cfg)


def load_parts(backend) -> dict[str, float]:
    """Where the backend's load went (``backend.load_stages``: seconds by part, where the
    backend keeps them), as ``load.<part>`` timings for the "ready in" line."""
    parts = getattr(backend, "load_stages", None)
    if not isinstance(parts, dict):
        return {}
    return {f"load.{k}": float(v) for k, v in parts.items() if isinstance(v, (int, float))}


def resolve(name: str):
    """``"package.module:function"`` -> the function."""
    module, _, attr = name.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def worker_command(fd: int) -> list[str]:
    """The command line of a worker that talks over the inherited socket ``fd``."""
    return [sys.executable, "-c", "import sys; from qwen_trt.serving.worker import main; "
            "sys.exit(main(int(sys.argv[1])))", str(fd)]


def main(fd: int) -> int:
    """Entry point of the worker process: read the spec from the socket, then serve."""
    import signal
    import socket

    # Ctrl-C in a terminal reaches the whole process group: it is for the client (stop this
    # reply), never for the engine. The parent stops the worker by closing the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from qwen_trt.serving.ipc import SocketConn

    conn = SocketConn(socket.socket(fileno=fd))
    try:
        kind, spec, parent_pid = conn.recv()
    except (EOFError, OSError):
        return 0
    if kind != "init":
        return 2
    worker_main(conn, spec, parent_pid)
    return 0


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent is gone (it cannot close the pipe if it was killed mid-load)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def worker_main(conn, spec: WorkerSpec, parent_pid: int) -> None:
    """Load, report, serve (``conn``: anything with send / recv / poll)."""
    t0 = time.monotonic()
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="qwen-trt-parent-watch").start()
    timings: dict[str, float] = {}

    def stage(line: str) -> None:
        conn.send(("stage", line, round(time.monotonic() - t0, 3)))

    try:
        step_limit_s = max_step_s()
        stage("importing torch and the backend")
        t = time.monotonic()
        if spec.loader == DEFAULT_LOADER:
            # timed here: the largest part of a cold start on CPU. Not transformers: the fast
            # backend imports it on the thread that loads the tokenizer, beside CUDA's start
            # and the weights (the HF backend imports it when it loads).
            import torch  # noqa: F401
        loader = resolve(spec.loader)
        runner_factory = resolve(spec.runner) if spec.runner else make_runner
        timings["import_s"] = time.monotonic() - t
        name = spec.cfg.backend
        stage(f"loading the model ({name} backend{', with warm-up' if spec.cfg.warmup else ''})")
        t = time.monotonic()
        backend = load_for_spec(loader, spec)
        timings["load_and_warmup_s"] = time.monotonic() - t
        timings.update(load_parts(backend))
        tokenizer = _load_tokenizer(backend)   # beside the runner's build and warm-up
        stage("starting the runner")
        t = time.monotonic()
        runner = (runner_factory(backend) if spec.runner
                  else make_runner(backend, max_batch=spec.cfg.max_batch, cfg=spec.cfg))
        if spec.kv_events is not None:
            from qwen_trt.serving.kv_events import publishing

            runner = publishing(runner, spec.kv_events, say=stage)
        timings["runner_s"] = time.monotonic() - t
        t = time.monotonic()
        tokenizer.join()                       # ready means loaded: nothing lazy after it
        timings["tokenizer_wait_s"] = time.monotonic() - t
    except BaseException as e:  # noqa: BLE001 - the parent shows one line; a traceback on debug
        from qwen_trt.debug import debug_enabled

        if debug_enabled():            # qwen-trt --debug / QWEN_TRT_DEBUG=1
            import traceback

            traceback.print_exc(file=sys.stderr)
        _send_quietly(conn, ("load_error", _load_error_line(e), _picklable_error(e)))
        return
    timings["total_s"] = time.monotonic() - t0
    source = getattr(backend, "tokenizer_source", None)      # without loading it
    if source is None:
        source = getattr(backend.tokenizer, "name_or_path", "") or ""
    beat = None
    every_s = beat_interval(getattr(spec.cfg, "watchdog_s", 0))
    if every_s:                       # the parent's watchdog: beat while a long step runs
        conn = LockedConn(conn)
        beat = Heartbeat(conn, every_s, step_limit_s)
    from qwen_trt.backends.kernel_paths import with_kernel_paths

    info = with_kernel_paths(backend.info, backend, runner)   # the path of each kernel family
    try:
        conn.send(("ready", Ready(info, str(source), int(runner.max_concurrency),
                                  {k: round(v, 3) for k, v in timings.items()}, os.getpid())))
        serve(conn, runner, beat)
    except (EOFError, OSError):
        pass                          # the parent went away
    finally:
        try:
            backend.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    # Skip the interpreter's teardown (seconds with torch loaded on a busy machine): the OS frees
    # the process's memory and the driver its GPU context.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _load_tokenizer(backend) -> threading.Thread:
    """The backend's Hugging Face tokenizer (a fast backend loads it on first use: its grammars)
    read on a thread started now, beside the runner's warm-up, and joined before the worker
    says it is ready: read after ready it ran beside the first requests (the first minute's
    stalls). A failure here is left for the request that needs it to report."""
    def load() -> None:
        try:
            backend.tokenizer
        except Exception:  # noqa: BLE001 - raised again, with its line, where it is needed
            pass
    thread = threading.Thread(target=load, daemon=True, name="qwen-trt-tokenizer-load")
    thread.start()
    return thread


def pack(events) -> list[tuple]:
    """TokenEvents as plain tuples ``(id, token_ids, finish, error, cached_tokens, logprobs)``
    (logprobs as ``(token_id, logprob, top)`` tuples, ``()`` when off): pickling a step's batch
    of 32 this way costs a fraction of pickling the dataclasses (bench/ipc.py)."""
    return [(e.request_id, e.token_ids, e.finish, e.error, e.cached_tokens,
             tuple((lp.token_id, lp.logprob, lp.top) for lp in e.logprobs)) for e in events]


def serve(conn, runner, beat=None) -> None:
    """Take messages between steps, step, send each step's events as one message; ``beat`` (a
    :class:`~qwen_trt.serving.liveness.Heartbeat`) beats while a step runs."""
    from qwen_trt.serving.serial import FatalDeviceError, error_detail

    stepping = beat.step if beat is not None else contextlib.nullcontext

    last_stats = 0.0
    stats_due = True
    steps, step_s, send_s, send_cpu_s = 0, 0.0, 0.0, 0.0
    # the engine's own first-token time per request: taken off the pipe -> its first token
    # sent back (the server's /debug/hops puts it beside the API's part)
    arrived: dict[int, float] = {}
    first_ms: deque = deque(maxlen=2048)

    def stats() -> dict:
        d = asdict(runner.stats())
        d["worker"] = {"steps": steps, "step_s": round(step_s, 6), "send_s": round(send_s, 6),
                       "send_cpu_s": round(send_cpu_s, 6),
                       "first_token_ms": _quantiles(first_ms)}
        return d

    while True:
        if not runner.has_work():
            if stats_due:
                conn.send(("events", [], stats()))
                stats_due = False
            if not _handle(conn.recv(), runner, conn, arrived):
                return
        while conn.poll():
            if not _handle(conn.recv(), runner, conn, arrived):
                return
        if not runner.has_work():
            continue
        t = time.perf_counter()
        try:
            with stepping():
                events = runner.step()
        except FatalDeviceError as e:
            conn.send(("fatal", str(e)))
            return
        except Exception as e:  # noqa: BLE001 - a runner bug: its state is unknown, restart
            import traceback

            traceback.print_exc(file=sys.stderr)
            conn.send(("fatal", error_detail(e)))
            return
        t1 = time.perf_counter()
        steps += 1
        step_s += t1 - t
        st = None
        if t1 - last_stats >= STATS_EVERY_S:
            st, last_stats = stats(), t1
        stats_due = True
        if events or st is not None:
            c = time.thread_time()
            conn.send(("events", pack(events), st))
            send_cpu_s += time.thread_time() - c
            sent = time.perf_counter()
            send_s += sent - t1
            if arrived:
                for ev in events:
                    t0 = arrived.pop(ev.request_id, None) if (ev.token_ids or ev.finish) else None
                    if t0 is not None and ev.token_ids:
                        first_ms.append((sent - t0) * 1e3)


def _quantiles(ms) -> dict:
    from qwen_trt.stats import percentile

    xs = list(ms)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50": round(percentile(xs, 50), 3),
            "p90": round(percentile(xs, 90), 3)}


def _handle(msg, runner, conn, arrived: dict | None = None) -> bool:
    kind = msg[0]
    if kind == "submit":
        _, rid, prompt_ids, params = msg
        if arrived is not None:
            arrived[rid] = time.perf_counter()
        try:
            runner.add(rid, prompt_ids, params)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            from qwen_trt.serving.serial import error_line

            if arrived is not None:
                arrived.pop(rid, None)
            conn.send(("events", [(rid, (), "error", error_line(e), 0, ())], None))
    elif kind == "abort":
        runner.abort(msg[1])
    elif kind == "stop":
        return False
    return True


def _load_error_line(e: BaseException) -> str:
    from qwen_trt.errors import QwenTrtError

    if isinstance(e, QwenTrtError):
        return str(e).replace("\n", " ")
    from qwen_trt.serving.serial import error_detail

    return f"Unexpected error while loading the model ({error_detail(e)})."


def _picklable_error(e: BaseException):
    """A QwenTrtError itself (the parent re-raises its type: the CLI's exit code), if it pickles."""
    import pickle

    from qwen_trt.errors import QwenTrtError

    if not isinstance(e, QwenTrtError):
        return None
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001
        return None
    return e


def _send_quietly(conn, msg) -> None:
    try:
        conn.send(msg)
    except (OSError, EOFError):
        pass
