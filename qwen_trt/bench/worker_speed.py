"""The engine process as its clients see it: load time, and the speed a client gets against
the engine's own speed, in one run (the target: the client at >= 95 % of the engine).

    python -m qwen_trt.bench.worker_speed --model DIR [--concurrency 1,8,32] \\
        [--prompt-len 512] [--new-tokens 256] [--no-in-process] --out worker_speed.json

1. **Load**: an :class:`~qwen_trt.serving.client.WorkerClient` is started as ``qwen-trt serve``
   starts it (the default loader, the batched runner unless ``--max-batch 1``); ``load``
   holds the wall time from the constructor's start to ready, the worker's stage lines with the
   time each was seen, and the stage timings the worker reports (``WorkerClient.timings``).
2. **Client vs engine**, per concurrency N: N greedy requests of ``prompt_len`` random token ids
   and exactly ``new_tokens`` new tokens (``ignore_eos``) submitted at once through the client
   (detokenization and metrics included, as the app and the API get them). Compared with

   * ``step_timer``: the worker's own counters from ``status().runner["worker"]`` over the same
     requests: the time spent inside ``runner.step()``; the rest of the worker's loop (IPC in
     and out, bookkeeping) and the client side are what the ratio charges;
   * ``in_process`` (unless ``--no-in-process``): after the engine process is stopped, the same
     backend and runner built in this process by the worker's own functions
     (:func:`~qwen_trt.serving.worker.load_for_spec`, :func:`~qwen_trt.serving.worker.make_runner`)
     and driven with the same requests without any IPC (``qwen_trt.bench.serving.drive``).

   ``output_tok_s`` = all new tokens / (first submit -> last token); ``decode_tok_s`` = tokens
   after each stream's first / (first stream's first token -> last token), llama.cpp's S_TG.
   ``client_over_*`` are the client's ``output_tok_s`` over the reference's. ``same_tokens``:
   how many of the N client replies have exactly the in-process token ids (greedy; in bf16 a
   different batch composition can flip a near-tie, see docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from qwen_trt.bench.measure import percentile
from qwen_trt.params import SamplingParams

LOAD_TARGET_S = 60.0
RATIO_TARGET = 0.95


@dataclass(frozen=True)
class WorkerSpeedConfig:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    fast: str = "auto"                    # the fast path: auto = on CUDA ("on": CPU tests)
    max_batch: int | None = None          # as `qwen-trt serve` (None: the runner's default)
    concurrency: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 512
    new_tokens: int = 256
    in_process: bool = True
    seed: int = 0
    timeout_s: float = 600.0              # per workload

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency values must be >= 1")
        if self.prompt_len < 1 or self.new_tokens < 2:
            raise ValueError("prompt_len must be >= 1 and new_tokens >= 2")


class StageLog:
    """The client's echo (its ``[qwen-trt engine] ...`` lines), each with the time it arrived;
    lines are passed on to ``echo``."""

    def __init__(self, t0: float, echo=sys.stderr) -> None:
        self.t0, self.echo = t0, echo
        self.lines: list[dict] = []
        self._buf = ""
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        with self._lock:
            self._buf += s
            while "\n" in self._buf:
                line, self._buf = self._buf.split("\n", 1)
                if line.strip():
                    self.lines.append({"t_s": round(time.monotonic() - self.t0, 3),
                                       "line": line.strip()})
        if self.echo is not None:
            self.echo.write(s)
        return len(s)

    def flush(self) -> None:
        if self.echo is not None:
            self.echo.flush()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def _prompts(cfg: WorkerSpeedConfig, n: int, vocab: int, salt: int) -> list[list[int]]:
    rng = random.Random(cfg.seed * 1_000_003 + salt)
    return [[rng.randrange(1, vocab) for _ in range(cfg.prompt_len)] for _ in range(n)]


def _worker_counters(client, before: int | None, timeout: float = 30.0,
                     settle_s: float = 0.05) -> dict:
    """The worker's counters once it is idle after more than ``before`` steps (it sends them
    when it runs out of work) and they have not moved for ``settle_s`` (a step still in flight
    after the last token, e.g. a chained decode, is counted where it belongs)."""
    deadline = time.monotonic() + timeout
    seen, since = None, 0.0
    while True:
        st = client.status().runner
        w = st.get("worker") or {}
        idle = st.get("running", 0) == 0 and st.get("waiting", 0) == 0
        if w and idle and (before is None or w["steps"] > before):
            if w != seen:
                seen, since = dict(w), time.monotonic()
            elif time.monotonic() - since >= settle_s:
                return seen
        if time.monotonic() > deadline:
            raise TimeoutError("the worker process sent no idle counters in "
                               f"{timeout:.0f} s (status: {st})")
        time.sleep(0.005)


def _rates(tokens: int, t_start: float, firsts: list[float], lasts: list[float],
           streams: int) -> dict:
    wall = max(lasts) - t_start
    span = max(lasts) - min(firsts)
    after_first = tokens - streams
    return {"wall_s": round(wall, 4), "tokens": tokens,
            "output_tok_s": round(tokens / wall, 1) if wall > 0 else None,
            "decode_tok_s": round(after_first / span, 1) if span > 0 else None}


def _client_run(client, prompts: list[list[int]], params: SamplingParams,
                timeout: float) -> tuple[dict, list[list[int]]]:
    c0 = _worker_counters(client, None)
    t = time.monotonic()
    handles = [client.submit(p, params) for p in prompts]
    replies = [h.result(timeout) for h in handles]
    firsts = [h.started_at + r.metrics.ttft_ms / 1e3 for h, r in zip(handles, replies)]
    lasts = [h.started_at + r.metrics.total_ms / 1e3 for h, r in zip(handles, replies)]
    tokens = sum(r.metrics.tokens for r in replies)
    c1 = _worker_counters(client, c0["steps"])
    res = _rates(tokens, t, firsts, lasts, len(prompts))
    res["ttft_ms_p50"] = round(percentile([r.metrics.ttft_ms for r in replies], 50), 2)
    res["per_stream_decode_tok_s_p50"] = round(
        percentile([r.metrics.decode_tok_s for r in replies], 50), 1)
    res["finish"] = sorted({r.metrics.finish_reason for r in replies})
    steps = c1["steps"] - c0["steps"]
    step_s = c1["step_s"] - c0["step_s"]
    timer = {"steps": steps, "step_s": round(step_s, 4),
             "send_s": round(c1["send_s"] - c0["send_s"], 4),
             "output_tok_s": round(tokens / step_s, 1) if step_s > 0 else None,
             "step_ms_mean": round(step_s / steps * 1e3, 3) if steps else None}
    return {"client": res, "step_timer": timer}, [list(r.token_ids) for r in replies]


def _in_process_run(runner, prompts: list[list[int]], params: SamplingParams,
                    device: str) -> tuple[dict, list[list[int]]]:
    from qwen_trt.bench.serving import drive

    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    streams, _ = drive(runner, [(0.0, p, params) for p in prompts])
    tokens = sum(len(s.stamps) for s in streams)
    res = _rates(tokens, 0.0, [s.stamps[0] for s in streams], [s.stamps[-1] for s in streams],
                 len(streams))
    return res, [list(s.ids) for s in streams]


def run_worker_speed(cfg: WorkerSpeedConfig, log=None, echo=sys.stderr, progress=None) -> dict:
    """Everything in the module docstring; returns the JSON-ready dict. ``progress(partial)``
    is called after each part (so a run cut short still leaves its figures so far)."""
    progress = progress or (lambda _res: None)
    from qwen_trt.backends import BackendConfig
    from qwen_trt.serving.client import WorkerClient
    from qwen_trt.serving.worker import WorkerSpec

    log = log or (lambda s: print(f"[worker_speed] {s}", file=sys.stderr, flush=True))
    bcfg = BackendConfig(model=cfg.model, device=cfg.device, dtype=cfg.dtype, fast=cfg.fast,
                         max_batch=cfg.max_batch)
    spec = WorkerSpec(bcfg)
    out: dict = {"tool": "qwen_trt.bench.worker_speed", "config": asdict(cfg),
                 "env": {"python": platform.python_version(), "host": platform.node(),
                         "cpus": os.cpu_count(), "load_avg": round(os.getloadavg()[0], 2)}}
    t0 = time.monotonic()
    stages = StageLog(t0, echo)
    client = WorkerClient(spec, echo=stages)
    client_tokens: dict[int, list[list[int]]] = {}
    try:
        ready_s = time.monotonic() - t0
        info = client.info
        out["load"] = {"ready_s": round(ready_s, 3), "target_s": LOAD_TARGET_S,
                       "within_target": ready_s <= LOAD_TARGET_S,
                       "timings": dict(client.timings), "stages": list(stages.lines)}
        out["engine"] = {"backend": info.name, "device": info.device, "dtype": info.dtype,
                         "model": info.model, "max_seq_len": info.max_seq_len,
                         "max_concurrency": client.max_concurrency}
        log(f"ready in {ready_s:.1f} s: {info.describe()}, {client.max_concurrency} at once")
        out["levels"] = levels = []
        progress(out)
        vocab = client.tokenizer.vocab_size
        top = max(cfg.concurrency)
        # warm-up: every batch bucket up to the largest N once, through the whole path
        warm = _prompts(cfg, top, vocab, salt=999)
        for h in [client.submit(p, _greedy(4)) for p in warm]:
            h.result(cfg.timeout_s)
        for n in cfg.concurrency:
            prompts = _prompts(cfg, n, vocab, salt=n)
            row, toks = _client_run(client, prompts, _greedy(cfg.new_tokens), cfg.timeout_s)
            client_tokens[n] = toks
            c, s = row["client"], row["step_timer"]
            row = {"concurrency": n, **row}
            if c["output_tok_s"] and s["output_tok_s"]:
                row["client_over_step_timer"] = round(c["output_tok_s"] / s["output_tok_s"], 4)
            levels.append(row)
            log(f"c={n}: client {c['output_tok_s']} tok/s, engine steps {s['output_tok_s']} "
                f"tok/s, ratio {row.get('client_over_step_timer')}")
            progress(out)
    finally:
        client.close()
    if cfg.in_process:
        _in_process(cfg, spec, out, client_tokens, log, progress)
    out["targets"] = {"load_s": LOAD_TARGET_S, "client_over_engine": RATIO_TARGET}
    return out


def _in_process(cfg: WorkerSpeedConfig, spec, out: dict, client_tokens, log, progress) -> None:
    """The same requests on the same backend and runner, built in this process."""
    from qwen_trt.serving.worker import load_for_spec, make_runner, resolve

    t = time.monotonic()
    backend = load_for_spec(resolve(spec.loader), spec)
    runner = make_runner(backend, max_batch=spec.cfg.max_batch)
    out["in_process_load_s"] = round(time.monotonic() - t, 3)
    device = str(getattr(getattr(backend, "decoder", None), "device", "cpu"))
    vocab = backend.tokenizer.vocab_size
    try:
        warm = _prompts(cfg, max(cfg.concurrency), vocab, salt=999)
        _in_process_run(runner, warm, _greedy(4), device)
        for row in out["levels"]:
            n = row["concurrency"]
            prompts = _prompts(cfg, n, vocab, salt=n)
            res, toks = _in_process_run(runner, prompts, _greedy(cfg.new_tokens), device)
            row["in_process"] = res
            if res["output_tok_s"] and row["client"]["output_tok_s"]:
                row["client_over_in_process"] = round(
                    row["client"]["output_tok_s"] / res["output_tok_s"], 4)
            theirs = client_tokens.get(n, [])
            row["same_tokens"] = sum(a == b for a, b in zip(theirs, toks))
            log(f"c={n}: in process {res['output_tok_s']} tok/s, client/in-process "
                f"{row.get('client_over_in_process')}, same tokens {row['same_tokens']}/{n}")
            progress(out)
    finally:
        backend.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.worker_speed",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder (or hub id)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--fast", default="auto", choices=("auto", "on", "off"),
                   help="the fast path (auto: on CUDA); 'on' runs the batched runner on CPU")
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--no-in-process", dest="in_process", action="store_false",
                   help="skip the in-process reference (the step timer is still compared)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON here (also printed)")
    args = p.parse_args(argv)
    cfg = WorkerSpeedConfig(model=args.model, device=args.device, dtype=args.dtype,
                            fast=args.fast, max_batch=args.max_batch,
                            concurrency=tuple(int(c) for c in args.concurrency.split(",")),
                            prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                            in_process=args.in_process, seed=args.seed)
    command = "python -m qwen_trt.bench.worker_speed " + " ".join(
        argv if argv is not None else sys.argv[1:])

    def save(res: dict) -> None:
        res["command"] = command
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=2) + "\n")

    res = run_worker_speed(cfg, progress=save)
    save(res)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
