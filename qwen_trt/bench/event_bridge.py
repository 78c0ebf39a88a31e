"""What moving tokens from the engine thread to the HTTP event loop costs, per event, on CPU.

    python -m qwen_trt.bench.event_bridge [--streams 1,8,32,64] [--steps 200] --out x.json

A producer thread plays the worker client's reader: every step it emits one Delta for each of
N requests (then a Finished), at a fixed step period. The consumers are the two ways
``qwen-trt serve`` has had of getting them onto its asyncio loop:

* ``thread``: one pump thread per request blocking on the handle's queue, each event posted with
  its own ``loop.call_soon_threadsafe`` (``api.server._thread_events``, the fallback for handles
  without ``listen``);
* ``sink``: :mod:`qwen_trt.serving.async_events`: the handle calls a listener, the step's events
  for all requests reach the loop in one wake-up (``batch()``).

Reported per mode and stream count: process CPU microseconds per event (all threads: the cost
the API process pays per token per request), event-loop wake-ups per step, and emit -> loop
latency percentiles. CPU time is robust to a busy machine where wall-clock is not. JSON out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time

from qwen_trt.bench.measure import percentile
from qwen_trt.params import Reply, ReplyMetrics, SamplingParams


class _Owner:
    def _position(self, handle) -> int:
        return 0

    def _cancel(self, handle) -> None:
        pass


def _produce(handles, steps: int, period_s: float, use_batch: bool, stamps: dict) -> None:
    from qwen_trt.serving.async_events import batch
    from qwen_trt.serving.events import Delta, Finished

    nxt = time.perf_counter()
    for step in range(steps):
        nxt += period_s
        delay = nxt - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = time.perf_counter()
        stamps[step] = t
        if use_batch:
            with batch():
                for h in handles:
                    h._emit(Delta(f"{step} "))
        else:
            for h in handles:
                h._emit(Delta(f"{step} "))
    reply = Reply("", ReplyMetrics(tokens=steps))
    with batch():
        for h in handles:
            h._emit(Finished(reply))


async def _consume(mode: str, handles, stamps: dict, lat: list) -> None:
    from qwen_trt.api.server import _events, _thread_events
    from qwen_trt.serving.events import Delta

    async def one(h) -> None:
        events = _events(h, poll_s=1.0) if mode == "sink" else _thread_events(h, 1.0)
        async for ev in events:
            if isinstance(ev, Delta):
                now = time.perf_counter()
                # every step's text is "<step> ": the latest step in this delta
                last = int(ev.text.split()[-1])
                lat.append(now - stamps[last])

    await asyncio.gather(*(one(h) for h in handles))


def run_mode(mode: str, streams: int, steps: int, period_s: float) -> dict:
    from qwen_trt.serving.async_events import sink_for
    from qwen_trt.serving.events import RequestHandle

    owner = _Owner()
    params = SamplingParams(max_new_tokens=steps)
    handles = [RequestHandle(owner, i, [1], params, 0) for i in range(streams)]
    stamps: dict[int, float] = {}
    lat: list[float] = []
    loop = asyncio.new_event_loop()
    sink = sink_for(loop)
    consumer = loop.create_task(_consume(mode, handles, stamps, lat))
    loop.run_until_complete(asyncio.sleep(0.05))     # listeners / pump threads in place
    cpu0, t0 = time.process_time(), time.perf_counter()
    producer = threading.Thread(target=_produce,
                                args=(handles, steps, period_s, mode == "sink", stamps))
    producer.start()
    loop.run_until_complete(consumer)
    producer.join()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    loop.close()
    events = streams * steps
    us = [x * 1e6 for x in lat]
    return {"mode": mode, "streams": streams, "steps": steps, "events": events,
            "cpu_us_per_event": round(cpu / events * 1e6, 2),
            "cpu_share_of_core": round(cpu / wall, 3),
            "loop_wakeups_per_step": (round(sink.wakeups / (steps + 1), 2) if mode == "sink"
                                      else None),
            "deltas_received": len(lat),
            "latency_us_p50": round(percentile(us, 50), 1),
            "latency_us_p90": round(percentile(us, 90), 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.event_bridge")
    p.add_argument("--streams", default="1,8,32,64")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=5.0, help="step period of the producer")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.streams.split(",")):
        for mode in ("thread", "sink"):
            rows.append(run_mode(mode, n, args.steps, args.step_ms / 1e3))
            print(json.dumps(rows[-1]), file=sys.stderr)
    res = {"tool": "qwen_trt.bench.event_bridge", "step_ms": args.step_ms, "rows": rows}
    text = json.dumps(res, indent=2)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
