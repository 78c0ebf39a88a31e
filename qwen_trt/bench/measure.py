"""Timing primitives: token arrival times of one run, percentiles, copy bandwidth."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from qwen_trt.stats import percentile  # noqa: F401  (the benchmarks import it from here)


@dataclass
class RunTiming:
    """One request: time to first token, and the decode rate after it."""

    ttft_ms: float
    decode_tok_s: float
    tokens: int
    token_ids: list[int]


def time_stream(start: Callable[[], Iterable[int]]) -> RunTiming:
    """Run ``start()`` (a token-id iterator) to the end, stamping each token as it arrives."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    ids: list[int] = []
    for tok in start():
        stamps.append(time.perf_counter())
        ids.append(int(tok))
    return timing_from_stamps(t0, stamps, ids)


def timing_from_stamps(t0: float, stamps: list[float], ids: list[int]) -> RunTiming:
    """TTFT from ``t0`` to the first stamp; decode rate over the rest."""
    if not stamps:
        return RunTiming(float("nan"), float("nan"), 0, [])
    span = stamps[-1] - stamps[0]
    rate = (len(stamps) - 1) / span if len(stamps) > 1 and span > 0 else float("nan")
    return RunTiming((stamps[0] - t0) * 1e3, rate, len(stamps), ids)


def graph_us(fn: Callable[[int], object], calls: int) -> float:
    """µs per ``fn(i)`` call (``i`` = 0..calls-1) replayed in one CUDA graph (the kernel
    benchmarks and sweeps time launches this way, without the host in the loop)."""
    import torch

    from qwen_trt.fast.step.graphs import capture, replay_ms

    graph = capture(lambda: [fn(i) for i in range(calls)], lambda: None,
                    torch.cuda.graph_pool_handle())
    return replay_ms(graph, 10, warmup=2) * 1000 / calls


def copy_bandwidth_tbps(device, gib: float = 4.0, iters: int = 10) -> float | None:
    """Device-to-device copy bandwidth (bytes read + written), None off CUDA."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    n = int(gib * 1024**3) // 2
    x = torch.empty(n, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        y.copy_(x)
    end.record()
    end.synchronize()
    dt = start.elapsed_time(end) / 1e3 / iters
    del x, y
    torch.cuda.empty_cache()
    return 2 * n * 2 / dt / 1e12
