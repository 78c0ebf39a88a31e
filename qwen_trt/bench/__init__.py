"""Side-by-side latency benchmark (``qwen-trt bench``): HF generate (eager, static cache), the
torch backend's reference path, the fast path and TensorRT-LLM, on the same prompts."""
from __future__ import annotations

from qwen_trt.bench.paths import PATHS
from qwen_trt.bench.report import Row, markdown
from qwen_trt.bench.run import BenchConfig, run_bench

__all__ = ["BenchConfig", "PATHS", "Row", "markdown", "run_bench"]
