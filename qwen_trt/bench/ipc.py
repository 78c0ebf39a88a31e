"""What the engine process costs per token: the IPC measured with runners that make tokens as
fast as possible, so the transport is all that is timed.

``python -m qwen_trt.bench.ipc --out build/out/ipc.json [--model TINY_DIR]``

Figures in CPU time per step are the ones to compare on a shared machine; wall-clock rates
move with the load (``load_avg`` in the JSON).

1. Transport alone, the worker's own loop (:func:`qwen_trt.serving.worker.serve`) in a spawned
   child over (a) ``multiprocessing.Pipe`` (the choice) and (b) a socketpair with pickled, length-
   prefixed batches read through a buffer; ``N`` streams, one event per stream per step, all
   events of a step in one message. The worker's own counters give the time its loop spends in
   ``send`` per step (what the engine pays: the receiver runs in parallel in the parent); the
   parent's receive rate says how fast a reader keeps up. Plus pickling one step's batch as
   dataclasses vs tuples. Then the same with a paced engine (``--paced-us`` per step, 2.5 ms like
   the H200's batch-1 decode): what the reader sees over what the engine makes.
2. End to end through :class:`~qwen_trt.serving.client.WorkerClient` (detokenization and metrics
   included): decode tok/s a client sees vs the runner's own rate in process, 1 and 8 streams.

ZMQ is not measured: pyzmq is not installed, and a Pipe already costs microseconds per step.
"""
from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import pickle
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

from qwen_trt.serving.ipc import SocketConn
from qwen_trt.backends.runner import RunnerStats, TokenEvent

TOKEN_IDS = (14990, 1879, 11, 419, 374, 264, 1273, 13)   # real ids: detokenizing does real work


class FastRunner:
    """Up to ``max_concurrency`` requests; each step gives every one its next token, at once."""

    def __init__(self, max_concurrency: int = 32, step_us: float = 0.0) -> None:
        self.max_concurrency = max_concurrency
        self.step_s = step_us / 1e6             # a paced engine: busy-wait this long per step
        self.reqs: dict[int, list] = {}
        self.done: list[TokenEvent] = []

    def add(self, request_id, prompt_ids, params) -> None:
        self.reqs[request_id] = [params.max_new_tokens, 0]

    def abort(self, request_id) -> None:
        if self.reqs.pop(request_id, None) is not None:
            self.done.append(TokenEvent(request_id, finish="cancelled"))

    def has_work(self) -> bool:
        return bool(self.reqs or self.done)

    def _pace(self) -> None:
        """The step's own time: busy-wait ``step_s``."""
        if self.step_s:
            end = time.perf_counter() + self.step_s
            while time.perf_counter() < end:
                pass

    def step(self) -> list[TokenEvent]:
        self._pace()
        events, self.done = self.done, []
        for rid, r in list(self.reqs.items()):
            r[1] += 1
            tok = TOKEN_IDS[r[1] % len(TOKEN_IDS)]
            if r[1] >= r[0]:
                del self.reqs[rid]
                events.append(TokenEvent(rid, (tok,), finish="length"))
            else:
                events.append(TokenEvent(rid, (tok,)))
        return events

    def stats(self) -> RunnerStats:
        return RunnerStats(running=len(self.reqs))


def _child(kind: str, end, streams: int, step_us: float) -> None:
    from qwen_trt.serving.worker import serve

    conn = SocketConn(end) if kind == "socket" else end
    try:
        serve(conn, FastRunner(streams, step_us))
    except (EOFError, OSError):
        pass


def _in_process(streams: int, tokens: int) -> float:
    """Seconds per step of the runner alone (plus the Python loop around it)."""
    from qwen_trt.params import SamplingParams

    r = FastRunner(streams)
    for i in range(streams):
        r.add(i, [1], SamplingParams(max_new_tokens=tokens))
    t = time.perf_counter()
    steps = 0
    while r.has_work():
        r.step()
        steps += 1
    return (time.perf_counter() - t) / steps


def transport(kind: str, streams: int, tokens: int, step_us: float = 0.0) -> dict:
    """Spawn the worker loop with ``kind`` transport; the parent reads every step's batch."""
    from qwen_trt.params import SamplingParams

    ctx = mp.get_context("spawn")
    if kind == "pipe":
        parent, child = ctx.Pipe(duplex=True)
    else:
        a, b = socket.socketpair()
        parent, child = SocketConn(a), b
    proc = ctx.Process(target=_child, args=(kind, child, streams, step_us), daemon=True)
    proc.start()
    child.close()
    params = SamplingParams(max_new_tokens=tokens)
    worker = []
    for _ in range(2):            # warm the path (imports, first pickles), then measure
        for i in range(streams):
            parent.send(("submit", i, [1], params))
        got = finished = messages = 0
        t0, c0 = time.perf_counter(), time.thread_time()
        while finished < streams:
            msg = parent.recv()
            if msg[0] != "events":
                continue
            messages += 1
            for ev in msg[1]:
                got += len(ev[1])
                finished += ev[2] is not None
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        while True:               # the worker's own counters, sent once it is idle
            msg = parent.recv()
            if msg[0] == "events" and not msg[1] and msg[2] is not None:
                worker.append(msg[2]["worker"])
                break
    parent.send(("stop",))
    proc.join(10)
    steps = worker[1]["steps"] - worker[0]["steps"]
    send = worker[1]["send_s"] - worker[0]["send_s"]
    send_cpu = worker[1]["send_cpu_s"] - worker[0]["send_cpu_s"]
    step = worker[1]["step_s"] - worker[0]["step_s"]
    return {"transport": kind, "streams": streams, "step_us": step_us, "tokens": got,
            "messages": messages, "wall_s": round(wall, 4), "received_tok_s": round(got / wall, 1),
            "us_per_step": round(wall / steps * 1e6, 2),
            "worker_step_us": round(step / steps * 1e6, 2),
            "worker_send_us_per_step": round(send / steps * 1e6, 2),
            # CPU time (robust on a busy machine): what sending costs the engine's loop, and
            # what receiving (unpickling, routing) costs the reader
            "worker_send_cpu_us_per_step": round(send_cpu / steps * 1e6, 2),
            "reader_cpu_us_per_step": round(cpu / steps * 1e6, 2),
            # the rate a reader sees over the engine's own (step time alone)
            "received_over_engine": round(step / wall, 4) if step_us else None}


def pickling(streams: int, repeats: int = 2000) -> dict:
    """Pickle + unpickle one step's batch: TokenEvent dataclasses vs the tuples the worker sends."""
    from qwen_trt.serving.worker import pack

    events = [TokenEvent(i, (TOKEN_IDS[i % 8],)) for i in range(streams)]
    out = {"streams": streams}
    for name, batch in (("dataclass", events), ("tuples", pack(events))):
        msg = ("events", batch, None)
        t = time.perf_counter()
        for _ in range(repeats):
            pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        out[f"{name}_us"] = round((time.perf_counter() - t) / repeats * 1e6, 2)
    return out


def end_to_end(model: str, streams: int, tokens: int) -> dict:
    """Decode tok/s a client of the engine process sees (detokenized, measured per reply)."""
    from qwen_trt.backends import BackendConfig
    from qwen_trt.params import SamplingParams
    from qwen_trt.serving.client import WorkerClient
    from qwen_trt.serving.worker import WorkerSpec

    client = WorkerClient(WorkerSpec(BackendConfig(model=model),
                                     loader="qwen_trt.bench.ipc:load_fake",
                                     runner=f"qwen_trt.bench.ipc:runner_{streams}"),
                          echo=io.StringIO())
    try:
        params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        client.submit([1], SamplingParams(max_new_tokens=200, ignore_eos=True)).result(60)
        t = time.perf_counter()
        handles = [client.submit([1], params) for _ in range(streams)]
        replies = [h.result(300) for h in handles]
        wall = time.perf_counter() - t
    finally:
        client.close()
    per_stream = sorted(r.metrics.decode_tok_s for r in replies)
    total = sum(r.metrics.tokens for r in replies)
    return {"streams": streams, "tokens": total, "wall_s": round(wall, 4),
            "client_tok_s": round(total / wall, 1),
            "per_stream_decode_tok_s_p50": round(per_stream[len(per_stream) // 2], 1)}


class _FakeBackend:
    """Just enough of a Backend for the worker: info, tokenizer, close."""

    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        from qwen_trt.backends.base import BackendInfo

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.info = BackendInfo("fake", model, "cpu", "-", 1 << 20, 1 << 20, ())

    def close(self) -> None:
        pass


def load_fake(cfg):
    return _FakeBackend(cfg.model)


def runner_1(backend):
    return FastRunner(1)


def runner_8(backend):
    return FastRunner(8)


def _tiny_model() -> str:
    from qwen_trt.model.tiny import write_tiny_model

    return str(write_tiny_model(Path(tempfile.mkdtemp(prefix="ipc-bench-"))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="build/out/ipc.json")
    p.add_argument("--tokens", type=int, default=4000, help="tokens per stream")
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--model", default=None, help="a folder with a tokenizer (default: tiny model)")
    p.add_argument("--repeats", type=int, default=3, help="best of N per transport")
    p.add_argument("--paced-us", type=float, default=0.0,
                   help="also run a runner that busy-waits this long per step, e.g. 2500 like "
                        "the H200's batch-1 decode (wall-clock figures: an idle machine only)")
    p.add_argument("--paced-steps", type=int, default=400)
    args = p.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    result = {"host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
              "load_avg": os.getloadavg()[0], "tokens_per_stream": args.tokens,
              "pickle_batch": [pickling(n) for n in streams], "transport": [], "end_to_end": []}
    print(json.dumps(result["pickle_batch"]), file=sys.stderr)
    for n in streams:
        inproc = min(_in_process(n, args.tokens) for _ in range(args.repeats))
        for kind in ("pipe", "socket"):
            best = min((transport(kind, n, args.tokens) for _ in range(args.repeats)),
                       key=lambda r: r["wall_s"])
            best["in_process_us_per_step"] = round(inproc * 1e6, 2)
            result["transport"].append(best)
            print(json.dumps(best), file=sys.stderr)
            if args.paced_us:
                paced = min((transport(kind, n, args.paced_steps, args.paced_us)
                             for _ in range(args.repeats)), key=lambda r: r["wall_s"])
                result["transport"].append(paced)
                print(json.dumps(paced), file=sys.stderr)
    model = args.model or _tiny_model()
    for n in (1, 8):
        inproc = _in_process(n, args.tokens)
        row = end_to_end(model, n, args.tokens)
        row["in_process_tok_s"] = round(n / inproc, 1)
        result["end_to_end"].append(row)
        print(json.dumps(row), file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
