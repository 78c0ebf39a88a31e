"""Timing a captured CUDA graph (the warm-up tile choices and the profilers use it)."""
from __future__ import annotations

import torch


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
