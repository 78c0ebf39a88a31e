"""``qwen-trt bench --concurrency 1,8,32``: many streams at once through the batch runner.

Everything runs in one process against one model (the runner driven directly, as the worker
does; the client/IPC cost is measured by the worker's own bench). Workloads, per concurrency N:

* ``burst``: N requests of ``prompt_len`` random tokens and ``new_tokens`` new tokens (EOS
  ignored) all arriving at t=0;
* ``poisson``: 2N requests with exponential gaps at a rate that keeps about N streams active
  (N / the mean request time of the burst run, Little's law);
* ``fifo``: the burst workload through the same runner limited to one sequence at a time (the
  one-at-a-time service of before this work), keys ``fifo``;
* ``long_prompt``: N streams decoding when a ``long_prompt``-token prompt arrives: the
  inter-token latency of the running streams until its first token (chunked prefill's bound);
* ``multi_turn``: one chat of ``turns`` turns (``turn_tokens`` per turn: a user message, then a
  reply of half that), each turn's prompt = the previous prompt + the reply's token ids + the new
  message; time to first token per turn with prefix reuse on and off.

Figures: aggregate decode tok/s (the tokens after each stream's first, over the span from the
first stream's first token to the last token: llama.cpp's S_TG), wall output tok/s (all new
tokens over first arrival -> last token), per-stream decode tok/s p50, TTFT p50/p95, ITL p95,
KV blocks in use at the peak. ``batch1`` measures today's batch-1 decoder (``FastDecoder``) on
the same weights in the same process before the batch runner takes them over.
"""
from __future__ import annotations

import gc
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from qwen_trt.bench.measure import percentile
from qwen_trt.params import SamplingParams


@dataclass(frozen=True)
class ServingBenchConfig:
    model: str | None = None
    random_weights: bool = False
    shape: str = "qwen3-4b"
    device: str = "auto"
    dtype: str = "auto"
    concurrency: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 512
    new_tokens: int = 256
    long_prompt: int = 2048
    turns: int = 10
    turn_tokens: int = 300
    token_budget: int = 1024
    max_batch: int | None = None          # default: the largest concurrency
    block_size: int = 32
    max_seq_len: int = 4096
    fifo: bool = True
    poisson: bool = True
    batch1: bool = True                   # today's FastDecoder first, same weights
    seed: int = 0
    command: str = ""
    quantization: str = "auto"            # the fast path's weight format (none, fp8, int4)

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency values must be >= 1")
        if self.quantization not in ("auto", "none", "fp8", "int4"):
            raise ValueError(f"unknown quantization {self.quantization!r}; choose from none, "
                             "fp8, int4 (one per serving run)")
        if min(self.prompt_len, self.new_tokens, self.long_prompt, self.turns,
               self.turn_tokens) < 1:
            raise ValueError("prompt, token and turn counts must be >= 1")
        need = max(self.prompt_len, self.long_prompt) + self.new_tokens
        if need > self.max_seq_len or self.turns * self.turn_tokens > self.max_seq_len:
            raise ValueError(f"--max-seq-len {self.max_seq_len} is too small for this workload")


@dataclass
class Stream:
    arrival: float
    stamps: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    cached: int = 0
    finish: str | None = None


def drive(runner, requests: Sequence[tuple[float, list[int], SamplingParams]],
          on_step: Callable[[float], None] | None = None,
          clock: Callable[[], float] = time.perf_counter) -> tuple[list[Stream], int]:
    """Feed ``requests`` (arrival seconds from now, prompt, params) to ``runner`` as they
    arrive and step it until all finish; returns each request's token stamps and the peak of
    KV blocks in use."""
    t0 = clock()
    order = sorted(range(len(requests)), key=lambda i: requests[i][0])
    streams = [Stream(requests[i][0]) for i in range(len(requests))]
    nxt = 0
    peak = 0
    while nxt < len(order) or runner.has_work():
        now = clock() - t0
        while nxt < len(order) and requests[order[nxt]][0] <= now:
            i = order[nxt]
            runner.add(i, requests[i][1], requests[i][2])
            nxt += 1
        if not runner.has_work():
            time.sleep(max(0.0, min(requests[order[nxt]][0] - now, 0.05)))
            continue
        events = runner.step()
        t = clock() - t0
        for ev in events:
            s = streams[ev.request_id]
            if not s.stamps and not ev.token_ids and ev.finish == "error":
                raise RuntimeError(ev.error)
            if not s.stamps:
                s.cached = ev.cached_tokens
            s.stamps += [t] * len(ev.token_ids)
            s.ids += ev.token_ids
            s.finish = ev.finish or s.finish
        peak = max(peak, runner.stats().kv_blocks_used)
        if on_step:
            on_step(t)
    return streams, peak


def summarize(streams: Sequence[Stream]) -> dict:
    """The figures of one workload (module docstring)."""
    done = [s for s in streams if s.stamps]
    firsts = [s.stamps[0] for s in done]
    lasts = [s.stamps[-1] for s in done]
    after_first = sum(len(s.stamps) - 1 for s in done)
    span = max(lasts) - min(firsts) if done else 0.0
    total = sum(len(s.stamps) for s in done)
    wall = max(lasts) - min(s.arrival for s in done) if done else 0.0
    per_stream = [(len(s.stamps) - 1) / (s.stamps[-1] - s.stamps[0]) for s in done
                  if len(s.stamps) > 1 and s.stamps[-1] > s.stamps[0]]
    ttft = [(s.stamps[0] - s.arrival) * 1e3 for s in done]
    itl = [(b - a) * 1e3 for s in done for a, b in zip(s.stamps, s.stamps[1:])]
    latency = [s.stamps[-1] - s.arrival for s in done]
    r = lambda v, n=2: None if v is None else round(v, n)   # noqa: E731
    return {
        "streams": len(streams), "tokens": total,
        "aggregate_decode_tok_s": r(after_first / span if span > 0 else None, 1),
        "wall_output_tok_s": r(total / wall if wall > 0 else None, 1),
        "per_stream_tok_s_p50": r(percentile(per_stream, 50) if per_stream else None, 1),
        "ttft_ms_p50": r(percentile(ttft, 50)), "ttft_ms_p95": r(percentile(ttft, 95)),
        "itl_ms_p50": r(percentile(itl, 50) if itl else None),
        "itl_ms_p95": r(percentile(itl, 95) if itl else None),
        "mean_request_s": r(sum(latency) / len(latency), 3) if latency else None,
        "tokens_ok": all(s.finish == "length" for s in streams),
    }


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_serving_bench(cfg: ServingBenchConfig, log=print, progress=None) -> dict:
    import torch

    from qwen_trt.backends.torch_backend import pick_device, pick_dtype
    from qwen_trt.bench.measure import copy_bandwidth_tbps, time_stream
    from qwen_trt.fast import SHAPES, FastConfig, load_fast_decoder
    from qwen_trt.model.source import resolve_model
    from qwen_trt.serving.scheduler import BatchRunner, SchedulerConfig, make_batch_runner

    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    cuda = device.startswith("cuda")
    if cfg.random_weights:
        fcfg, weights, name = SHAPES[cfg.shape], None, f"random:{cfg.shape}"
    else:
        source = resolve_model(cfg.model)
        fcfg, weights, name = FastConfig.from_hf(source.config), source.path, source.name
    rng = random.Random(cfg.seed)
    hi = min(fcfg.vocab_size, 150000)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, hi) for _ in range(n)]

    elem = torch.finfo(dtype).bits // 8
    copy_tbps = copy_bandwidth_tbps(device)
    out: dict = {
        "command": cfg.command, "config": asdict(cfg),
        "env": {"torch": torch.__version__, "python": platform.python_version(),
                "device": device, "gpu": torch.cuda.get_device_name(device) if cuda else None,
                "dtype": str(dtype).replace("torch.", ""),
                "copy_TBps": None if copy_tbps is None else round(copy_tbps, 3)},
        "model": {"name": name, "params": fcfg.n_params,
                  "weight_GB": round(fcfg.n_params * elem / 1e9, 3),
                  "kv_bytes_per_token": fcfg.kv_bytes_per_token(elem)},
    }
    t = time.perf_counter()
    decoder = load_fast_decoder(fcfg, weights=weights, max_seq_len=cfg.max_seq_len, dtype=dtype,
                                device=device, seed=cfg.seed, warmup=cfg.batch1,
                                quantization=cfg.quantization)
    out["load_s"] = round(time.perf_counter() - t, 2)
    out["model"].update(quantization=decoder.model.quant.method,
                        packed_weight_GB=round(decoder.model.weight_bytes / 1e9, 3))
    if cfg.batch1:      # today's batch-1 decoder, same weights, before the runner takes over
        log("[bench] batch-1 decoder ...")
        p = prompt(cfg.prompt_len)
        for _ in range(2):
            time_stream(lambda: decoder.generate(p, _greedy(8)))
        runs = [time_stream(lambda: decoder.generate(p, _greedy(cfg.new_tokens)))
                for _ in range(5)]
        out["batch1_decoder"] = {
            "ttft_ms_p50": round(percentile([r.ttft_ms for r in runs], 50), 2),
            "decode_tok_s_p50": round(percentile([r.decode_tok_s for r in runs], 50), 1),
            "kernels": decoder.stats.kernels, "attention": decoder.stats.attention}
        log(f"[bench] batch-1 decoder: {out['batch1_decoder']}")
    model = decoder.model
    decoder._decode_graphs.clear()
    decoder._prefill_graphs.clear()
    del decoder
    gc.collect()
    max_batch = cfg.max_batch or max(cfg.concurrency)
    kv_tokens = max_batch * (cfg.prompt_len + cfg.new_tokens) + cfg.long_prompt \
        + 2 * cfg.turns * cfg.turn_tokens + 4096
    t = time.perf_counter()
    base = make_batch_runner(model, SchedulerConfig(max_batch=max_batch,
                                                    token_budget=cfg.token_budget),
                             kv_tokens=kv_tokens, block_size=cfg.block_size,
                             checked=cfg.batch1)
    bm = base.model
    out["batched"] = {"warmup_s": round(time.perf_counter() - t, 2), **asdict(bm.stats),
                      "kv_blocks": bm.cache.num_blocks, "block_size": bm.block_size,
                      "kv_cache_GB": round(bm.cache.nbytes / 1e9, 3),
                      "token_budget": cfg.token_budget, "max_batch": max_batch}
    log(f"[bench] batched runner ready: {out['batched']}")

    def runner(**kw) -> BatchRunner:    # a fresh allocator (no prefix state) per workload
        conf = dict(max_batch=max_batch, token_budget=cfg.token_budget)
        conf.update(kw)
        return BatchRunner(bm, SchedulerConfig(**conf))

    block_bytes = fcfg.kv_bytes_per_token(elem) * bm.block_size

    def measure(r, reqs, label: str) -> dict:
        _sync(device)
        streams, peak = drive(r, reqs)
        res = summarize(streams)
        res["kv_peak_blocks"] = peak
        res["kv_peak_GB"] = round(peak * block_bytes / 1e9, 3)
        res["steps"] = r.steps
        res["max_step_tokens"] = r.max_step_tokens
        log(f"[bench] {label}: " + ", ".join(f"{k}={v}" for k, v in res.items()
                                             if k in ("aggregate_decode_tok_s", "ttft_ms_p50",
                                                      "ttft_ms_p95", "itl_ms_p95")))
        return res

    # warm-up: every bucket once, and a prefill chunk of each size class
    drive(runner(), [(0.0, prompt(cfg.prompt_len), _greedy(4)) for _ in range(max_batch)])
    res: dict = {"burst": {}, "poisson": {}, "fifo": {}, "long_prompt": {}}
    for n in cfg.concurrency:
        reqs = [(0.0, prompt(cfg.prompt_len), _greedy(cfg.new_tokens)) for _ in range(n)]
        res["burst"][str(n)] = b = measure(runner(), reqs, f"burst c={n}")
        if cfg.poisson:
            rate = n / max(b["mean_request_s"], 1e-3)
            at, preqs = 0.0, []
            for _ in range(max(2 * n, 4)):
                preqs.append((at, prompt(cfg.prompt_len), _greedy(cfg.new_tokens)))
                at += rng.expovariate(rate)
            res["poisson"][str(n)] = measure(runner(), preqs, f"poisson c={n}")
            res["poisson"][str(n)]["rate_per_s"] = round(rate, 2)
        if cfg.fifo:
            res["fifo"][str(n)] = measure(runner(max_batch=1), reqs, f"fifo c={n}")
        res["long_prompt"][str(n)] = _long_prompt(runner(), n, cfg, prompt, log)
        if progress:
            progress({**out, **res})
    res["multi_turn"] = _multi_turn(runner, cfg, prompt, log)
    out.update(res)
    if "batch1_decoder" in out and "1" in res["burst"]:
        b1 = res["burst"]["1"]
        out["batch1_ratio"] = {
            "decode": round(b1["per_stream_tok_s_p50"]
                            / out["batch1_decoder"]["decode_tok_s_p50"], 3),
            "ttft": round(out["batch1_decoder"]["ttft_ms_p50"] / b1["ttft_ms_p50"], 3)}
    return out


def _long_prompt(r, n: int, cfg: ServingBenchConfig, prompt, log) -> dict:
    """N streams decoding; a long prompt arrives once they all have 8 tokens: the ITL of the
    running streams from its arrival to its first token."""
    for i in range(n):
        r.add(i, prompt(cfg.prompt_len), _greedy(cfg.new_tokens))
    stamps: dict[int, list[float]] = {i: [] for i in range(n + 1)}
    t_arrive = None
    warm = min(8, max(1, cfg.new_tokens // 4))
    while r.has_work() or t_arrive is None:
        if t_arrive is None and all(len(stamps[i]) >= warm for i in range(n)):
            t_arrive = time.perf_counter()
            r.add(n, prompt(cfg.long_prompt), _greedy(4))
        events = r.step()
        now = time.perf_counter()
        for ev in events:
            stamps[ev.request_id] += [now] * len(ev.token_ids)
    first_long = stamps[n][0]
    itl = [(b - a) * 1e3 for i in range(n) for a, b in zip(stamps[i], stamps[i][1:])
           if a >= t_arrive - 0.05 and b <= first_long + 1e-9 and b > t_arrive]
    out = {"long_prompt": cfg.long_prompt, "long_ttft_ms": round((first_long - t_arrive) * 1e3, 2),
           "itl_ms_p95_during_prefill": round(percentile(itl, 95), 2) if itl else None,
           "itl_ms_max_during_prefill": round(max(itl), 2) if itl else None,
           "itl_samples": len(itl), "max_step_tokens": r.max_step_tokens}
    log(f"[bench] long prompt c={n}: {out}")
    return out


def _multi_turn(make_runner, cfg: ServingBenchConfig, prompt, log) -> dict:
    user = max(1, cfg.turn_tokens // 2)
    reply = max(1, cfg.turn_tokens - user)
    convo = [prompt(user) for _ in range(cfg.turns)]
    out = {}
    for reuse in (True, False):
        r = make_runner(prefix_caching=reuse)
        history: list[int] = []
        ttft, cached = [], []
        for turn in range(cfg.turns):
            p = history + convo[turn]
            streams, _ = drive(r, [(0.0, p, _greedy(reply))])
            s = streams[0]
            ttft.append(round((s.stamps[0] - s.arrival) * 1e3, 2))
            cached.append(s.cached)
            history = p + s.ids        # the reply's token ids, not re-encoded text
        key = "reuse" if reuse else "no_reuse"
        out[key] = {"ttft_ms": ttft, "cached_tokens": cached,
                    "turn_last_over_first": round(ttft[-1] / ttft[0], 2)}
        log(f"[bench] multi-turn {key}: {out[key]}")
    return out
