"""CUDA graphs of the fast path: how they are captured, and how a captured one is timed (the
warm-up's choices and the profilers)."""
from __future__ import annotations

from collections.abc import Callable

import torch


def capture(body: Callable[[], None], reset: Callable[[], None],
            pool=None, warmups: int = 2) -> torch.cuda.CUDAGraph:
    """A graph of ``body``: first ``warmups`` runs on a side stream (compiles and autotuning
    happen there, outside the capture), each after ``reset()`` puts the static inputs in a
    state safe to run; then ``reset()`` again and the capture, into the memory ``pool``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            reset()
            body()
    torch.cuda.current_stream().wait_stream(stream)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, n: int, warmup: int = 0) -> float:
    """Mean ms of ``n`` back-to-back replays of ``graph`` (CUDA events), after ``warmup``
    untimed ones."""
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n
