"""Where the served workload's GPU time goes, in process (``qwen-trt bench --http``'s workload).

    python -m qwen_trt.bench.timeline --model DIR [--concurrency 32] [--requests 96] \\
        [--input-words 400] [--output-tokens 256] [--profile-steps 200] [--batch1] --out F.json

The runner ``qwen-trt serve`` builds (the worker's own loader, ``--max-batch`` wide) runs the same
prompts two ways, stepped in this process with a record per step (its kind — ``decode`` rows
only, or ``prefill`` chunks with or without decode rows —, its decode rows, prefill tokens and
wall time):

1. **burst**: ``--concurrency`` requests added at once (every prompt prefilled first, then
   decode-only steps at the full batch): the per-step wall of those full decode steps is the
   baseline a served step is held to;
2. **closed loop**: ``--concurrency`` clients, each sending its next request when the last one
   finished (arrivals come one by one, as over HTTP), ``--requests`` in all. A window of
   ``--profile-steps`` steps in its middle runs under the torch profiler: the GPU's busy share
   of the window (the union of its kernels and copies), its idle gaps, and the busiest kernels.

``--batch1`` then loads the batch-1 decoder (``--max-batch 1``) and runs a few of the prompts
alone: the first token and decode speed a lone request is held to. JSON out; on CPU (tiny model)
a shape check of the tool, not a figure.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from qwen_trt.bench.served import stamp_events
from qwen_trt.params import SamplingParams
from qwen_trt.stats import percentile


@dataclass(frozen=True)
class TimelineConfig:
    model: str
    device: str = "auto"
    fast: str = "auto"
    max_batch: int = 32
    concurrency: int = 32
    requests: int = 96
    input_words: int = 400
    output_tokens: int = 256
    profile_steps: int = 200
    batch1: bool = False

    def __post_init__(self) -> None:
        if min(self.max_batch, self.concurrency, self.requests, self.output_tokens,
               self.input_words) < 1 or self.profile_steps < 0:
            raise ValueError("--max-batch, --concurrency, --requests, --output-tokens and "
                             "--input-words must be >= 1, --profile-steps >= 0")


def _prompts(tok, n: int, words: int, base: int) -> list[list[int]]:
    from qwen_trt.api.prompt import encode_messages
    from qwen_trt.bench.http_bench import prompt_text

    return [encode_messages(tok, [{"role": "user", "content": prompt_text(base + i, words)}])
            for i in range(n)]


def _load(cfg: TimelineConfig, max_batch: int):
    from qwen_trt.backends import BackendConfig
    from qwen_trt.serving.worker import WorkerSpec, load_for_spec, make_runner, resolve

    spec = WorkerSpec(BackendConfig(model=cfg.model, device=cfg.device, fast=cfg.fast,
                                    max_batch=max_batch))
    backend = load_for_spec(resolve(spec.loader), spec)
    return backend, make_runner(backend, max_batch=max_batch)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def drive(runner, prompts: list[list[int]], params: SamplingParams, clients: int,
          profile_window: tuple[int, int] | None = None) -> dict:
    """``prompts`` by ``clients`` closed-loop clients (``clients >= len(prompts)``: a burst);
    per-step records, per-request stamps, and the profiler's summary of ``profile_window``
    (first step, steps)."""
    todo = iter(range(len(prompts)))
    live: dict[int, list] = {}
    done: list[tuple[float, float, float, int]] = []
    steps: list[dict] = []
    errors = 0
    prof, window = None, None       # the profiler while it runs; then (it, first, end step)

    def send() -> None:
        i = next(todo, None)
        if i is not None:
            live[i] = [time.perf_counter(), None, None, 0]
            runner.add(i, prompts[i], params)

    for _ in range(min(clients, len(prompts))):
        send()
    t0 = time.perf_counter()
    while live:
        k = len(steps)
        if profile_window and k == profile_window[0]:
            prof = _profiler_start()
        t = time.perf_counter()
        events = runner.step()
        now = time.perf_counter()
        rec = dict(getattr(runner, "last_step", None) or {})
        rec["wall_ms"] = (now - t) * 1e3
        steps.append(rec)
        if prof is not None and k == profile_window[0] + profile_window[1] - 1:
            _sync()
            prof.__exit__(None, None, None)
            prof, window = None, (prof, profile_window[0], k + 1)
        finished, failed = stamp_events(live, done, events, now)
        errors += failed
        for _ in range(finished):       # (a burst has sent everything already)
            send()
    _sync()
    wall = time.perf_counter() - t0
    if prof is not None:            # the run ended inside the window
        prof.__exit__(None, None, None)
        window = (prof, profile_window[0], len(steps))
    out = {"requests": len(done), "errors": errors, "wall_s": round(wall, 3),
           "output_tok_s": round(sum(r[3] for r in done) / wall, 1) if wall else None,
           "ttft_ms_p50": _p([(f - s) * 1e3 for s, f, _, _ in done], 50),
           "itl_ms_p50": _p([(last - f) / (n - 1) * 1e3 for _, f, last, n in done if n > 1], 50),
           "steps": _step_summary(steps)}
    if window is not None:
        p, a, b = window
        out["profile"] = _profile_summary(p, steps[a:b])
    return out


def _p(xs, q):
    return round(percentile(xs, q), 3) if xs else None


def _step_summary(steps: list[dict]) -> dict:
    """Per kind and decode-row count: steps, wall ms mean/p50, prefill tokens mean."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for s in steps:
        kind = s.get("kind", "?")
        if kind == "none":
            continue
        rows = s.get("decode_rows", 0)
        band = "1" if rows <= 1 else f"{rows - rows % 8 or 2}+" if rows < 32 else "32+"
        groups[f"{kind} rows {band}"].append(s)
    out = {}
    for key, ss in sorted(groups.items()):
        walls = [s["wall_ms"] for s in ss]
        out[key] = {"steps": len(ss), "wall_ms_mean": round(sum(walls) / len(walls), 3),
                    "wall_ms_p50": _p(walls, 50), "wall_ms_sum": round(sum(walls), 1),
                    "prefill_tokens_mean": round(sum(s.get("prefill_tokens", 0) for s in ss)
                                                 / len(ss), 1)}
    return out


def _profiler_start():
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=acts)
    prof.__enter__()
    return prof


def _profile_summary(prof, window_steps: list[dict]) -> dict:
    """The GPU's busy share over the window (union of kernel / memcpy / memset intervals from
    the first to the last), its idle gaps and top kernels, from the profiler's chrome trace."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    evs = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    gpu = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", ""))
           for e in evs if e.get("ph") == "X"
           and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host_wall = sum(s["wall_ms"] for s in window_steps)
    res = {"steps": len(window_steps), "host_wall_ms": round(host_wall, 2),
           "gpu_events": len(gpu)}
    if not gpu:
        return res
    gpu.sort()
    busy, gaps = 0.0, []
    cur_a, cur_b = gpu[0][0], gpu[0][1]
    for a, b, _ in gpu[1:]:
        if a > cur_b:
            busy += cur_b - cur_a
            gaps.append(a - cur_b)
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    busy += cur_b - cur_a
    span = gpu[-1][1] - gpu[0][0] if gpu else 0.0
    per_kernel: dict[str, float] = defaultdict(float)
    for a, b, name in gpu:
        per_kernel[name[:80]] += b - a
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
    big = [g for g in gaps if g >= 50]
    res.update({"span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
                "busy_share": round(busy / span, 4) if span else None,
                "gaps_over_50us": len(big), "gaps_over_50us_ms": round(sum(big) / 1e3, 3),
                "gap_us_p50": _p(big, 50), "gap_us_max": round(max(gaps), 1) if gaps else 0,
                "top_kernels_ms": {k: round(v / 1e3, 3) for k, v in top}})
    return res


def run(cfg: TimelineConfig, log=print) -> dict:
    import gc

    t = time.monotonic()
    backend, runner = _load(cfg, cfg.max_batch)
    log(f"loaded {type(runner).__name__} in {time.monotonic() - t:.1f} s")
    tok = backend.tokenizer
    params = SamplingParams(max_new_tokens=cfg.output_tokens, temperature=0, ignore_eos=True)
    res: dict = {"tool": "qwen_trt.bench.timeline", "config": vars(cfg).copy(),
                 "runner": type(runner).__name__}
    try:
        drive(runner, _prompts(tok, 2, cfg.input_words, 9_000_000), params, 1)   # warm-up
        burst = _prompts(tok, cfg.concurrency, cfg.input_words, 7_000_000)
        res["prompt_tokens"] = len(burst[0])
        res["burst"] = drive(runner, burst, params, cfg.concurrency)
        log(f"burst: {res['burst']['output_tok_s']} tok/s")
        loop = _prompts(tok, cfg.requests, cfg.input_words, cfg.concurrency * 100_000)
        mid = max(0, cfg.requests * cfg.output_tokens // cfg.concurrency // 3)
        window = (mid, cfg.profile_steps) if cfg.profile_steps else None
        res["closed_loop"] = drive(runner, loop, params, cfg.concurrency, window)
        log(f"closed loop: {res['closed_loop']['output_tok_s']} tok/s, profile "
            f"{json.dumps({k: v for k, v in res['closed_loop'].get('profile', {}).items() if k != 'top_kernels_ms'})}")
        res["runner_stats"] = json.loads(json.dumps(getattr(runner.stats(), "__dict__", {}),
                                                    default=str))
    finally:
        backend.close()
        del runner, backend
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - best effort before the next load
            pass
    if cfg.batch1:
        backend, runner = _load(cfg, 1)
        try:
            solo = _prompts(tok, 3, cfg.input_words, 5_000_000)
            drive(runner, solo[:1], params, 1)
            res["batch1_decoder"] = drive(runner, solo[1:], params, 1)
            log(f"batch-1 decoder: {res['batch1_decoder']['output_tok_s']} tok/s")
        finally:
            backend.close()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.timeline",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--fast", default="auto")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--input-words", type=int, default=400)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--profile-steps", type=int, default=200)
    p.add_argument("--batch1", action="store_true", help="then the batch-1 decoder alone")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        cfg = TimelineConfig(a.model, a.device, a.fast, a.max_batch, a.concurrency, a.requests,
                             a.input_words, a.output_tokens, a.profile_steps, a.batch1)
    except ValueError as e:
        p.error(str(e))
    res = run(cfg, log=lambda m: print(f"[timeline] {m}", file=sys.stderr, flush=True))
    text = json.dumps(res, indent=2)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    print(text)
    return 0 if not res.get("closed_loop", {}).get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())
