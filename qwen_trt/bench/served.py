"""The served path against the engine behind it, on one workload (``qwen-trt bench --http``).

    python -m qwen_trt.bench.served --model DIR [--concurrency 1,8,32,64] [--max-batch 32] \\
        [--requests 64] [--input-words 400] [--output-tokens 256] --out served.json

Per level C, the same closed loop both ways: C clients, each sends a request, waits for its
last token and sends the next, until ``--requests`` have been sent (the first C start together,
then arrivals follow completions, so they come one by one as in production). The prompts are the
HTTP load generator's (:func:`qwen_trt.bench.http_bench.prompt_text`, request ``C*100000+i``)
through the chat template, greedy, lengths forced with ``ignore_eos``; ``--warmup`` requests
first each way.

0. at one stream, first **the batch-1 decoder** (the backend loaded with its own graphs,
   ``backend.stream``) on prompts of its own: the baseline of the one-stream first-token target;
1. **in process**: the runner ``qwen-trt serve`` would build (the worker's own
   :func:`~qwen_trt.serving.worker.load_for_spec` / :func:`~qwen_trt.serving.worker.make_runner`,
   ``--max-batch`` wide), stepped in this process; a request's tokens are stamped when its step
   returns. It is freed before step 2.
2. **over HTTP**: ``qwen-trt serve`` (a subprocess, the same options) and the HTTP load
   generator (:func:`qwen_trt.bench.http_bench.run_level`: streaming, stamps per SSE chunk).

Per level and path: output tok/s (all output tokens / the level's wall time), TTFT p50/p90,
ITL p50/p90 (per request: (last - first token) / (tokens - 1)), errors; and ``http_over_engine``
for output tok/s, plus the ITL and TTFT ratios. With more offered streams than ``--max-batch``
the rest queue (in the runner in process, in the API's queue over HTTP). JSON out; on CPU with
the tiny model it is a shape check, not a speed figure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from qwen_trt.params import DEFAULT_MAX_BATCH
from qwen_trt.bench.process import stop, wait_healthy
from qwen_trt.bench.measure import percentile
from qwen_trt.params import SamplingParams


@dataclass(frozen=True)
class ServedBenchConfig:
    model: str
    device: str = "auto"
    fast: str = "auto"
    max_batch: int = DEFAULT_MAX_BATCH
    concurrency: tuple[int, ...] = (1, 8, 32, 64)
    requests: int = 64
    input_words: int = 400
    output_tokens: int = 256
    warmup: int = 2
    serve_args: tuple[str, ...] = ()
    health_timeout_s: float = 600.0
    in_process: bool = True          # False: the HTTP side only
    second_start: bool = False       # then start `qwen-trt serve` again: the warm-cache start
    batch1: bool = True              # at one stream, the batch-1 decoder too (loads its graphs)
    rounds: int = 2                  # at least this many requests per client at each level

    def level_requests(self, c: int) -> int:
        """Requests sent at level ``c``: ``requests``, and at least ``rounds`` rounds of ``c``
        (the first round starts together; later ones arrive as earlier requests finish)."""
        return max(self.requests, self.rounds * c)

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("--concurrency values must be >= 1")
        if min(self.requests, self.output_tokens, self.max_batch, self.input_words,
               self.rounds) < 1:
            raise ValueError("--requests, --output-tokens, --max-batch, --input-words, --rounds "
                             "must be >= 1")


def _messages(i: int, words: int) -> list[dict]:
    from qwen_trt.bench.http_bench import prompt_text

    return [{"role": "user", "content": prompt_text(i, words)}]


def _level_stats(rows: list[tuple[float, float, float, int]], wall: float, errors: int) -> dict:
    """rows: (submitted, first token, last token, tokens) per finished request."""
    ttft = [(f - s) * 1e3 for s, f, _, _ in rows]
    itl = [(last - f) / (n - 1) * 1e3 for _, f, last, n in rows if n > 1]
    tokens = sum(n for *_, n in rows)

    def p(xs, q):
        return round(percentile(xs, q), 3) if xs else None

    return {"requests": len(rows), "errors": errors, "duration_s": round(wall, 3),
            "output_tok_s": round(tokens / wall, 1) if wall > 0 else None,
            "ttft_ms_p50": p(ttft, 50), "ttft_ms_p90": p(ttft, 90),
            "itl_ms_p50": p(itl, 50), "itl_ms_p90": p(itl, 90)}


def stamp_events(live: dict, done: list, events, now: float) -> tuple[int, int]:
    """A step's events stamped on their requests' rows in ``live`` (``[submitted, first token,
    last token, tokens]``); a finished request's row moves to ``done`` (an error or a request
    without tokens is counted instead). Returns (finished, errors)."""
    finished = errors = 0
    for ev in events:
        row = live.get(ev.request_id)
        if row is None:
            continue
        if ev.token_ids:
            if row[1] is None:
                row[1] = now
            row[2] = now
            row[3] += len(ev.token_ids)
        if ev.finish is not None:
            del live[ev.request_id]
            finished += 1
            if ev.finish == "error" or row[1] is None:
                errors += 1
            else:
                done.append(tuple(row))
    return finished, errors


def closed_loop(runner, prompts: list[list[int]], params: SamplingParams, clients: int) -> dict:
    """``prompts`` through ``runner`` by ``clients`` closed-loop clients (module docstring)."""
    todo = iter(range(len(prompts)))
    live: dict[int, list] = {}          # request -> [submitted, first, last, tokens]
    done: list[tuple[float, float, float, int]] = []
    errors = 0

    def send() -> bool:
        i = next(todo, None)
        if i is None:
            return False
        live[i] = [time.perf_counter(), None, None, 0]
        runner.add(i, prompts[i], params)
        return True

    t0 = time.perf_counter()
    steps, step_s = 0, 0.0
    for _ in range(clients):
        if not send():
            break
    while live:
        t = time.perf_counter()
        events = runner.step()
        now = time.perf_counter()
        steps += 1
        step_s += now - t
        finished, failed = stamp_events(live, done, events, now)
        errors += failed
        for _ in range(finished):
            send()
    out = _level_stats(done, time.perf_counter() - t0, errors)
    out["steps"], out["step_ms_mean"] = steps, round(step_s / max(steps, 1) * 1e3, 3)
    return out


def batch1_decoder(backend, prompts: list[list[int]], params: SamplingParams) -> dict | None:
    """``prompts`` one after another on a backend no runner holds yet (``backend.stream``: the
    batch-1 decoder on the fast path): the one-stream baseline of the first-token target (HTTP
    TTFT p50 <= this + 2 ms). The prompts must be new to it (its prefix reuse would shorten
    the prefill). None when the backend has no ``stream``."""
    stream = getattr(backend, "stream", None)
    if stream is None or getattr(backend, "attached_runner", None) is not None:
        return None
    rows = []
    t0 = time.perf_counter()
    for ids in prompts:
        sent, stamps = time.perf_counter(), []
        for _ in stream(ids, params):
            stamps.append(time.perf_counter())
        if stamps:
            rows.append((sent, stamps[0], stamps[-1], len(stamps)))
    return _level_stats(rows, time.perf_counter() - t0, len(prompts) - len(rows))


def _sync(backend) -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_in_process(cfg: ServedBenchConfig, log) -> tuple[dict, dict]:
    from qwen_trt.api.prompt import encode_messages
    from qwen_trt.backends import BackendConfig
    from qwen_trt.serving.worker import WorkerSpec, load_for_spec, make_runner, resolve

    spec = WorkerSpec(BackendConfig(model=cfg.model, device=cfg.device, fast=cfg.fast,
                                    max_batch=cfg.max_batch))
    params = SamplingParams(max_new_tokens=cfg.output_tokens, temperature=0, ignore_eos=True)
    t = time.monotonic()
    b1 = None
    if cfg.batch1 and 1 in cfg.concurrency:
        # the batch-1 decoder (its own graphs) first, on prompts of its own; then the runner
        # takes the weights over (what `serve --max-batch N` runs)
        backend = resolve(spec.loader)(spec.cfg)
        tok = backend.tokenizer
        b1_prompts = [encode_messages(tok, _messages(20_000_000 + i, cfg.input_words))
                      for i in range(cfg.warmup + cfg.level_requests(1))]
        t_b1 = time.monotonic()
        batch1_decoder(backend, b1_prompts[:cfg.warmup], params)
        b1 = batch1_decoder(backend, b1_prompts[cfg.warmup:], params)
        t += time.monotonic() - t_b1              # load_s: loading, not this measurement
        if b1 is not None:
            log(f"batch-1 decoder: {b1['output_tok_s']} tok/s, TTFT p50 {b1['ttft_ms_p50']} "
                f"ms, ITL p50 {b1['itl_ms_p50']} ms")
    else:
        backend = load_for_spec(resolve(spec.loader), spec)
    runner = make_runner(backend, max_batch=cfg.max_batch)
    load_s = time.monotonic() - t
    log(f"in process: loaded and warmed up in {load_s:.1f} s")
    tok = backend.tokenizer
    out: dict = {}
    try:
        for c in cfg.concurrency:
            warm = [encode_messages(tok, _messages(10_000_000 + w, cfg.input_words))
                    for w in range(cfg.warmup)]
            if warm:
                closed_loop(runner, warm, params, 1)
            prompts = [encode_messages(tok, _messages(c * 100_000 + i, cfg.input_words))
                       for i in range(cfg.level_requests(c))]
            _sync(backend)
            out[c] = closed_loop(runner, prompts, params, c)
            if c == 1 and b1 is not None:
                out[c]["batch1_decoder"] = b1
            log(f"in process c={c}: {out[c]['output_tok_s']} tok/s, TTFT p50 "
                f"{out[c]['ttft_ms_p50']} ms, ITL p50 {out[c]['itl_ms_p50']} ms")
        info = {"load_s": round(load_s, 3), "runner": type(runner).__name__,
                "prompt_tokens": len(prompts[0]) if prompts else 0,
                "runner_stats": _jsonable(runner.stats())}
    finally:
        backend.close()
        del runner, backend
        try:
            import gc

            import torch

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - best effort before the server loads its own copy
            pass
    return out, info


def _jsonable(stats) -> dict:
    from dataclasses import asdict

    try:
        return json.loads(json.dumps(asdict(stats), default=str))
    except TypeError:
        return {}


def run_http(cfg: ServedBenchConfig, log, workdir: Path,
             levels: tuple[int, ...] | None = None) -> tuple[dict, dict]:
    """``qwen-trt serve`` started, timed to healthy, loaded at ``levels`` (default the
    config's), stopped."""
    levels = cfg.concurrency if levels is None else levels
    from qwen_trt.bench.http_bench import parse_args, run_level, tok_free_port

    port = tok_free_port()
    cmd = [sys.executable, "-m", "qwen_trt.cli", "serve", "--model", cfg.model,
           "--device", cfg.device, "--fast", cfg.fast, "--max-batch", str(cfg.max_batch),
           "--port", str(port), "--served-model-name", "bench", "--log-level", "warning",
           "--max-queue", str(max(256, max(cfg.concurrency) * 2)), *cfg.serve_args]
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"serve-{port}.log"
    t = time.monotonic()
    with open(log_path, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, "QWEN_TRT_WORKER": "process"})
    out: dict = {}
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, cfg.health_timeout_s, "qwen-trt serve",
                     log_path=log_path)
        healthy_s = time.monotonic() - t
        log(f"qwen-trt serve healthy in {healthy_s:.1f} s")
        url = f"http://127.0.0.1:{port}/v1"
        for c in levels:
            before = _worker_counters(port)
            args = parse_args(["--requests", str(cfg.level_requests(c)), "--input-words",
                               str(cfg.input_words), "--output-tokens", str(cfg.output_tokens),
                               "--warmup", str(cfg.warmup)])
            lv = asyncio.run(run_level(url, "bench", c, args))
            out[c] = {"requests": lv.requests - lv.errors, "errors": lv.errors,
                      "duration_s": round(lv.duration_s, 3),
                      "output_tok_s": round(lv.output_token_throughput, 1),
                      "ttft_ms_p50": round(lv.ttft_ms_p50, 3),
                      "ttft_ms_p90": round(lv.ttft_ms_p90, 3),
                      "itl_ms_p50": round(lv.itl_ms_p50, 3), "itl_ms_p90": round(lv.itl_ms_p90, 3),
                      "first_error": lv.first_error}
            after = _worker_counters(port)
            if after and "hops_us" in after:       # the level's hops (the first level: its own)
                out[c]["hops_us"] = after["hops_us"]
            if before and after and after["steps"] > before["steps"]:   # the worker's timer
                n = after["steps"] - before["steps"]
                out[c]["steps"] = n
                out[c]["step_ms_mean"] = round((after["step_s"] - before["step_s"]) / n * 1e3, 3)
            log(f"over HTTP c={c}: {out[c]['output_tok_s']} tok/s, TTFT p50 "
                f"{out[c]['ttft_ms_p50']} ms, ITL p50 {out[c]['itl_ms_p50']} ms, "
                f"errors {lv.errors}")
        info = {"healthy_s": round(healthy_s, 3), "command": cmd[2:],
                "engine_lines": [ln for ln in log_path.read_text(errors="replace").splitlines()
                                 if "[qwen-trt engine]" in ln and "%|" not in ln][-12:]}
        try:
            import httpx

            info["metrics_excerpt"] = [ln for ln in httpx.get(
                f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines()
                if ln.startswith("qwen_trt_") and "bucket" not in ln][:40]
            hops = httpx.get(f"http://127.0.0.1:{port}/debug/hops", timeout=10)
            if hops.status_code == 200:          # QWEN_TRT_TRACE_HOPS=1: the server's hops
                info["hops_us"] = hops.json()
        except Exception:  # noqa: BLE001 - informational
            pass
    finally:
        stop(proc, 30)
    return out, info


def _worker_counters(port: int) -> dict | None:
    """The engine process's step counters (``/debug/hops`` with QWEN_TRT_TRACE_HOPS=1; they
    include the warm-up requests of the level, a few steps)."""
    import httpx

    try:
        r = httpx.get(f"http://127.0.0.1:{port}/debug/hops", timeout=10)
        if r.status_code != 200:
            return None
        body = r.json()
        w = (body.get("runner") or {}).get("worker") or {}
        if not w:
            return None
        hops = {k: v for k, v in body.items() if k != "runner"}
        # the engine's part of the first token (pipe -> its first token sent; the newest 2048)
        hops["engine_first_token_ms"] = w.get("first_token_ms")
        return {"steps": int(w["steps"]), "step_s": float(w["step_s"]), "hops_us": hops}
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def _ratio(a, b, digits=3):
    return round(a / b, digits) if a and b else None


def run_served_bench(cfg: ServedBenchConfig, log=print, workdir: Path | None = None,
                     progress=None) -> dict:
    """Both sides (module docstring); ``progress(result)`` gets the result so far before the
    second start."""
    workdir = workdir or Path("bench-results")
    engine, engine_info = run_in_process(cfg, log) if cfg.in_process else ({}, {})
    try:
        http, http_info = run_http(cfg, log, workdir)
    except RuntimeError as e:        # the server did not come up: keep the in-process side
        log(f"over HTTP failed: {str(e).splitlines()[0]}")
        http, http_info = {}, {"error": str(e)[-2000:]}
    if cfg.second_start and "error" not in http_info:
        if progress is not None:
            progress(_result(cfg, engine, engine_info, http, http_info))
        try:
            _, again = run_http(cfg, log, workdir, levels=())
            http_info["second_start_healthy_s"] = again["healthy_s"]
            http_info["second_start_engine_lines"] = again["engine_lines"]
        except RuntimeError as e:
            http_info["second_start_error"] = str(e)[-2000:]
    return _result(cfg, engine, engine_info, http, http_info)


def _result(cfg: ServedBenchConfig, engine: dict, engine_info: dict, http: dict,
            http_info: dict) -> dict:
    levels = []
    for c in cfg.concurrency:
        e, h = engine.get(c, {}), http.get(c, {})
        levels.append({
            "concurrency": c, "in_process": e, "http": h,
            "http_over_engine_tok_s": _ratio(h.get("output_tok_s"), e.get("output_tok_s")),
            "http_over_engine_itl_p50": _ratio(h.get("itl_ms_p50"), e.get("itl_ms_p50")),
            "http_over_engine_ttft_p50": _ratio(h.get("ttft_ms_p50"), e.get("ttft_ms_p50"))})
        b1 = e.get("batch1_decoder")
        if b1 and h.get("ttft_ms_p50") is not None:      # the one-stream targets
            levels[-1]["http_ttft_over_batch1_ms"] = round(h["ttft_ms_p50"] - b1["ttft_ms_p50"], 3)
            levels[-1]["http_decode_over_batch1"] = _ratio(
                1 / h["itl_ms_p50"] if h.get("itl_ms_p50") else None,
                1 / b1["itl_ms_p50"] if b1.get("itl_ms_p50") else None)
    return {"tool": "qwen_trt.bench.served", "config": {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
        "in_process": engine_info, "http": http_info, "levels": levels}


def summary(res: dict) -> str:
    lines = ["| C | in-process tok/s | HTTP tok/s | ratio | ITL p50 ms in/HTTP | "
             "TTFT p50 ms in/HTTP | TTFT p90 HTTP | step ms in/HTTP | errors |", "|" + "---|" * 9]
    for lv in res["levels"]:
        e, h = lv["in_process"], lv["http"]
        lines.append(f"| {lv['concurrency']} | {e.get('output_tok_s')} | {h.get('output_tok_s')} "
                     f"| {lv['http_over_engine_tok_s']} | {e.get('itl_ms_p50')} / "
                     f"{h.get('itl_ms_p50')} | {e.get('ttft_ms_p50')} / {h.get('ttft_ms_p50')} | "
                     f"{h.get('ttft_ms_p90')} | {e.get('step_ms_mean')} / "
                     f"{h.get('step_ms_mean')} | {e.get('errors', 0)} / {h.get('errors')} |")
    return "\n".join(lines)


def parse_config(argv=None) -> tuple[ServedBenchConfig, str | None]:
    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.served",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--fast", default="auto", help="the fast path (on: CPU smoke runs)")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--requests", type=int, default=64,
                   help="requests per level (at least 2 x the level)")
    p.add_argument("--input-words", type=int, default=400)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra `qwen-trt serve` argument (repeatable)")
    p.add_argument("--no-in-process", action="store_true", help="the HTTP side only")
    p.add_argument("--rounds", type=int, default=2,
                   help="at least this many requests per client at each level")
    p.add_argument("--no-batch1", action="store_true",
                   help="skip the batch-1 decoder's one-stream baseline")
    p.add_argument("--health-timeout", type=float, default=600.0,
                   help="seconds for `qwen-trt serve` to become healthy")
    p.add_argument("--second-start", action="store_true",
                   help="then time a second `qwen-trt serve` start (the compile cache warm)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        levels = tuple(int(x) for x in a.concurrency.split(",") if x.strip())
        cfg = ServedBenchConfig(model=a.model, device=a.device, fast=a.fast,
                                max_batch=a.max_batch, concurrency=levels, requests=a.requests,
                                input_words=a.input_words, output_tokens=a.output_tokens,
                                warmup=a.warmup, serve_args=tuple(a.serve_arg),
                                in_process=not a.no_in_process, second_start=a.second_start,
                                batch1=not a.no_batch1, rounds=a.rounds,
                                health_timeout_s=a.health_timeout)
    except ValueError as e:
        p.error(str(e).splitlines()[0])
    return cfg, a.out


def main(argv=None) -> int:
    cfg, out = parse_config(argv)

    def save(res: dict) -> None:
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(res, indent=2) + "\n")

    res = run_served_bench(cfg, log=lambda m: print(f"[served] {m}", file=sys.stderr, flush=True),
                           progress=save)
    save(res)
    text = json.dumps(res, indent=2)
    print(text)
    print(summary(res), file=sys.stderr)
    errors = sum((lv["http"].get("errors") or 0) + (lv["in_process"].get("errors") or 0)
                 for lv in res["levels"])
    return 0 if errors == 0 and "error" not in res["http"] else 1


if __name__ == "__main__":
    sys.exit(main())
