"""``qwen-trt bench``: every contender on the same prompts, in one process, one table.

Order: HF paths first (they share one HF model), then the fast path (built from the same
weights, after the HF model is freed, so its memory figure is its own), then TensorRT-LLM.
"""
from __future__ import annotations

import gc
import platform
import time
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from qwen_trt.errors import first_line
from qwen_trt.bench.measure import RunTiming, copy_bandwidth_tbps
from qwen_trt.bench.paths import (PATHS, Runner, backend_runner, build_hf_model, engine_runner,
                                  hf_runner)
from qwen_trt.bench.report import Row, add_ratios, summarize

SLOW_PATHS = ("hf-eager", "torch")   # launch-bound: fewer repeats


@dataclass(frozen=True)
class BenchConfig:
    model: str | None = None
    random_weights: bool = False
    shape: str = "qwen3-4b"
    device: str = "auto"
    dtype: str = "auto"
    prompt_lens: tuple[int, ...] = (128, 512, 2048)
    new_tokens: int = 256
    repeats: int = 5
    slow_repeats: int = 2
    paths: tuple[str, ...] = PATHS
    max_seq_len: int = 4096
    seed: int = 0
    command: str = ""
    # weight formats of the fast path, each measured as its own path: "none" is the
    # checkpoint as it is ("fast"), fp8 / int4 quantize it at load ("fast:fp8", "fast:int4")
    quantization: tuple[str, ...] = ("none",)

    def __post_init__(self) -> None:
        bad_q = [q for q in self.quantization if q not in ("none", "auto", "fp8", "int4")]
        if bad_q or not self.quantization:
            raise ValueError(f"unknown quantization {', '.join(bad_q) or '(none)'}; choose "
                             "from none, fp8, int4")
        bad = [p for p in self.paths if p not in PATHS]
        if bad:
            raise ValueError(f"unknown path(s) {', '.join(bad)}; choose from {', '.join(PATHS)}")
        if not self.prompt_lens or min(self.prompt_lens) < 1 or self.new_tokens < 1:
            raise ValueError("prompt lengths and new tokens must be >= 1")
        if min(self.repeats, self.slow_repeats) < 1:
            raise ValueError("repeats must be >= 1")


@dataclass
class PathReport:
    status: str = "ok"                  # ok | skipped: why | error: what
    info: dict = field(default_factory=dict)


def _cuda(device: str) -> bool:
    return device.startswith("cuda")


def _reset_peak(device: str) -> None:
    import torch

    if _cuda(device):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _gb(n: float) -> float:
    return round(n / 1e9, 3)


def _measure(name: str, run: Runner, prompts: dict[int, list[int]], cfg: BenchConfig,
             device: str, warm_tokens: int) -> tuple[list[Row], dict[int, list[int]]]:
    import torch

    lens = sorted(prompts, reverse=True)
    for n in lens:                       # warm-up (compiles, caches), longest first
        run(prompts[n], warm_tokens)
    repeats = cfg.slow_repeats if name in SLOW_PATHS else cfg.repeats
    rows, first_ids = [], {}
    _reset_peak(device)
    for n in lens:
        runs: list[RunTiming] = [run(prompts[n], cfg.new_tokens) for _ in range(repeats)]
        first_ids[n] = runs[0].token_ids
        rows.append(summarize(name, n, cfg.new_tokens, runs))
    if _cuda(device):
        peak = _gb(torch.cuda.max_memory_allocated())
        for r in rows:
            r.peak_mem_gb = peak
    return rows, first_ids


def _match_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _run_hf_path(p: str, hf, source, reports: dict[str, PathReport],
                 prompts: dict[int, list[int]], cfg: BenchConfig, device: str,
                 max_seq_len: int, load_s: float, log):
    """One HF-model path; returns (rows, first-run token ids) or None when skipped/failed.
    Its own function so nothing here keeps the HF model alive afterwards."""
    from qwen_trt.backends.torch_backend import TorchBackend

    rep = reports[p] = PathReport(info={"load_s": round(load_s, 2)})
    if p == "hf-static" and not _cuda(device):
        rep.status = "skipped: static cache + compile is measured on CUDA only"
        return None
    if p == "torch":
        run = backend_runner(TorchBackend(source, hf, None, device, max_seq_len))
    else:
        run = hf_runner(hf, static=p == "hf-static")
    log(f"[bench] {p} ...")
    t = time.perf_counter()
    try:
        rows, first_ids = _measure(p, run, prompts, cfg, device,
                                   warm_tokens=cfg.new_tokens if p == "hf-static" else 4)
    except Exception as e:  # one contender failing must not lose the others
        rep.status = first_line(f"error: {type(e).__name__}: {e}")[:300]
        return None
    rep.info["wall_s"] = round(time.perf_counter() - t, 1)
    log(f"[bench] {p}: " + ", ".join(f"{x.prompt_len}: {x.ttft_ms_p50:.1f} ms / "
                                      f"{x.decode_tok_s:.1f} tok/s" for x in rows))
    return rows, first_ids


def run_bench(cfg: BenchConfig, log=print, progress=None) -> dict:
    """Run every path of ``cfg``; ``progress(partial_result)`` is called after each path."""
    import torch
    import transformers

    from qwen_trt.backends.torch_backend import pick_device, pick_dtype
    from qwen_trt.fast import SHAPES, FastConfig, load_fast_decoder
    from qwen_trt.model.source import ModelSource, resolve_model

    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    if cfg.random_weights:
        fcfg = SHAPES[cfg.shape]
        source = ModelSource(path=None, name=f"random:{cfg.shape}", config=fcfg.to_hf())
        model_dir = None
    else:
        source = resolve_model(cfg.model)
        fcfg = FastConfig.from_hf(source.config)
        model_dir = source.path
    elem = torch.finfo(dtype).bits // 8
    weight_bytes = fcfg.n_params * elem
    max_seq_len = max(cfg.max_seq_len, max(cfg.prompt_lens) + cfg.new_tokens)
    copy_tbps = copy_bandwidth_tbps(device)
    g = torch.Generator().manual_seed(cfg.seed)
    hi = min(fcfg.vocab_size, 150000)
    prompts = {n: torch.randint(0, hi, (n,), generator=g).tolist() for n in cfg.prompt_lens}
    out: dict = {
        "command": cfg.command,
        "config": asdict(cfg),
        "env": {
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": device,
            "gpu": torch.cuda.get_device_name(device) if _cuda(device) else None,
            "dtype": str(dtype).replace("torch.", ""),
            "copy_TBps": None if copy_tbps is None else round(copy_tbps, 3),
        },
        "model": {"name": source.name, "params": fcfg.n_params, "weight_GB": _gb(weight_bytes),
                  "roofline_tok_s": None if copy_tbps is None
                  else round(copy_tbps * 1e12 / weight_bytes, 1),
                  "kv_bytes_per_token": fcfg.kv_bytes_per_token(elem)},
        "paths": {}, "rows": [], "parity": {},
    }
    rows: list[Row] = []
    ids: dict[str, dict[int, list[int]]] = {}
    reports: dict[str, PathReport] = {}

    hf_paths = [p for p in cfg.paths if p in ("hf-eager", "hf-static", "torch")]
    hf = None
    if hf_paths:
        t = time.perf_counter()
        hf = build_hf_model(fcfg, model_dir=model_dir, dtype=dtype, device=device)
        load_s = time.perf_counter() - t
        for p in hf_paths:
            r = _run_hf_path(p, hf, source, reports, prompts, cfg, device, max_seq_len, load_s,
                             log)
            if r is None:
                continue
            rows += r[0]
            ids[p] = r[1]
            if progress:
                progress(_finish(dict(out), list(rows), reports, ids, weight_bytes, copy_tbps))

    fast_runs = [q for q in cfg.quantization] if "fast" in cfg.paths else []
    path_bytes: dict[str, int] = {}
    for quant in fast_runs:
        name = "fast" if quant in ("none", "auto") else f"fast:{quant}"
        rep = reports[name] = PathReport()
        try:   # a compile/capture failure must not lose the rows already measured
            t = time.perf_counter()
            weights = hf.state_dict() if hf is not None else model_dir
            engine = load_fast_decoder(fcfg, weights=weights, max_seq_len=max_seq_len, dtype=dtype,
                                      device=device, seed=cfg.seed, warmup=False,
                                      quantization="auto" if quant == "none" else quant)
            del weights
            rep.info["quantization"] = engine.model.quant.method
            path_bytes[name] = engine.model.weight_bytes
            rep.info["load_s"] = round(time.perf_counter() - t, 2)
            if hf is not None:   # free the HF model and anything compiled for it
                hf_ref = weakref.ref(hf)
                del hf
                hf = None
                torch._dynamo.reset()
                gc.collect()
                rep.info["hf_model_freed"] = hf_ref() is None
            gc.collect()
            if _cuda(device):
                torch.cuda.empty_cache()
            _reset_peak(device)
            if _cuda(device):
                rep.info["resident_before_warmup_GB"] = _gb(torch.cuda.memory_allocated())
            log(f"[bench] {name}: compile + capture ...")
            stats = engine.warmup()
            rep.info.update(warmup_s=round(stats.warmup_s, 2), compile=stats.compile,
                            kernels=stats.kernels, attention=stats.attention,
                            notes=list(stats.notes),
                            graphs=stats.graphs, prefill_graphs=stats.prefill_graphs,
                            decode_graphs=stats.decode_graphs, max_seq_len=engine.max_seq_len,
                            kv_buckets=list(engine.kv_buckets),
                            kv_cache_GB=_gb(engine.model.cache.nbytes),
                            weights_GB=_gb(engine.model.weight_bytes))
            if _cuda(device):
                rep.info["resident_after_warmup_GB"] = _gb(torch.cuda.memory_allocated())
            r, ids[name] = _measure(name, engine_runner(engine), prompts, cfg, device,
                                    warm_tokens=4)
            rows += r
            if _cuda(device):
                rep.info["mem_vs_weights_plus_kv"] = round(
                    r[0].peak_mem_gb * 1e9 / (engine.model.weight_bytes + engine.model.cache.nbytes), 3)
            log(f"[bench] {name}: " + ", ".join(f"{x.prompt_len}: {x.ttft_ms_p50:.1f} ms / "
                                             f"{x.decode_tok_s:.1f} tok/s" for x in r))
            del engine
            gc.collect()
            if _cuda(device):
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - reported in the JSON, the run goes on
            rep.status = first_line(f"failed: {type(e).__name__}: {e}")
            log(f"[bench] {name}: {rep.status}")

    if "trtllm" in cfg.paths:
        rep = reports["trtllm"] = PathReport()
        if cfg.random_weights:
            rep.status = "skipped: needs a real checkpoint and a built engine"
        else:
            try:
                from qwen_trt.backends import BackendConfig, load_backend

                t = time.perf_counter()
                backend = load_backend(BackendConfig(backend="trtllm", model=cfg.model))
                rep.info["load_s"] = round(time.perf_counter() - t, 2)
                try:
                    r, ids["trtllm"] = _measure("trtllm", backend_runner(backend), prompts, cfg,
                                                device, warm_tokens=4)
                    rows += r
                finally:
                    backend.close()
            except Exception as e:  # missing library/engine is a skip, not a failure
                rep.status = first_line(f"skipped: {type(e).__name__}: {e}")[:300]

    return _finish(out, rows, reports, ids, weight_bytes, copy_tbps, path_bytes)


def _finish(out: dict, rows: list[Row], reports: dict[str, PathReport],
            ids: dict[str, dict[int, list[int]]], weight_bytes: int,
            copy_tbps: float | None, path_bytes: dict[str, int] | None = None) -> dict:
    add_ratios(rows, weight_bytes, copy_tbps)
    for r in rows:   # packed weights: the roofline of the bytes that path reads per step
        if copy_tbps and path_bytes and r.path in path_bytes and ":" in r.path:
            r.roofline_frac = path_bytes[r.path] * r.decode_tok_s / (copy_tbps * 1e12)
    rows = sorted(rows, key=lambda r: (PATHS.index(r.path.split(":")[0]), r.path,
                                       r.prompt_len))
    out["rows"] = [r.to_json() for r in rows]
    out["paths"] = {k: {"status": v.status, **v.info} for k, v in reports.items()}
    out["parity"] = {}
    ref = "hf-eager" if "hf-eager" in ids else ("torch" if "torch" in ids else None)
    if ref:
        for p, by_len in ids.items():
            if p != ref:
                out["parity"][f"{p}_vs_{ref}"] = {
                    str(n): {"matching_prefix": _match_prefix(toks, ids[ref].get(n, [])),
                             "of": len(toks)} for n, toks in by_len.items()}
    return out
