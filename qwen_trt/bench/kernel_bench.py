"""Measure the decode kernels on this GPU: ``python -m qwen_trt.bench.kernel_bench [--sweep]``.

For each projection of a Qwen3-4B decode step (qkv, o, gate/up, down, LM head) it times the
Triton kernel of :mod:`qwen_trt.fast.kernels.gemv` (every block configuration with ``--sweep``, else the
one :func:`~qwen_trt.fast.kernels.gemv.config_for` picks) against cuBLAS (``F.linear``, no fusions), and
the decode attention kernels at a few context lengths (split sizes with ``--sweep``).

Timing is the way a decode step sees it: a CUDA graph of back-to-back launches over as many
distinct weight copies as the model has layers (so the weights come from HBM, not L2), replayed
several times; the figure is the median µs per launch and the achieved weight bandwidth. Every
configuration is checked against the unfused reference first. Prints and writes JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from qwen_trt.fast.options import options, use
from qwen_trt.fast.model.config import QWEN3_4B
from qwen_trt.fast.kernels.gemv import GemvConfig, config_for, gemv, gemv_ref
from qwen_trt.fast.kernels.pdl import pdl_enabled


def shapes(cfg=QWEN3_4B) -> dict[str, dict]:
    return {
        "qkv": {"rows": cfg.q_size + 2 * cfg.kv_size, "k": cfg.hidden, "ln": True},
        "o": {"rows": cfg.hidden, "k": cfg.q_size, "residual": True},
        "gate_up": {"rows": 2 * cfg.intermediate, "k": cfg.hidden, "ln": True, "gate_up": True},
        "down": {"rows": cfg.hidden, "k": cfg.intermediate, "residual": True},
        "lm_head": {"rows": cfg.vocab_size, "k": cfg.hidden, "ln": True, "copies": 2},
    }


def time_graph(fn, reps: int = 7) -> float:
    """Median ms of one replay of a graph that runs ``fn`` once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def bench_shape(name: str, spec: dict, configs: list[GemvConfig | None], layers: int,
                dtype=torch.bfloat16) -> dict:
    rows, k = spec["rows"], spec["k"]
    copies = spec.get("copies", layers)
    gate_up = spec.get("gate_up", False)
    n = rows // 2 if gate_up else rows
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(rows, k, generator=g, device="cuda", dtype=dtype) * 0.02
          for _ in range(copies)]
    x = torch.randn(k, generator=g, device="cuda", dtype=dtype)
    ln = ((1 + 0.1 * torch.randn(k, generator=g, device="cuda")).to(dtype) if spec.get("ln")
          else None)
    res = torch.randn(n, generator=g, device="cuda", dtype=dtype) if spec.get("residual") else None
    kw = dict(ln=ln, eps=1e-6, residual=res, gate_up=gate_up)
    nbytes = rows * k * ws[0].element_size()
    ref = gemv_ref(ws[0], x, **kw).float()
    out = {"rows": rows, "k": k, "weight_MB": round(nbytes / 1e6, 2), "runs": []}

    def record(label: str, fn) -> None:
        ms = time_graph(fn)
        us = ms * 1e3 / copies
        out["runs"].append({"config": label, "us": round(us, 2),
                            "TBps": round(nbytes / (us * 1e-6) / 1e12, 3)})

    record("cublas F.linear (unfused)", lambda: [F.linear(x.view(1, k), w) for w in ws])
    if pdl_enabled(x.device):
        with use(options().replace(pdl=False)):
            record("auto without PDL", lambda: [gemv(w, x, **kw) for w in ws])
    for cfg in configs:
        label = "auto " + str(config_for(n, k, gate_up)) if cfg is None else str(cfg)
        try:
            got = gemv(ws[0], x, config=cfg, **kw).float()
            err = ((got - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                out["runs"].append({"config": label, "error": f"wrong result ({err:.2e})"})
                continue
            record(label, lambda cfg=cfg: [gemv(w, x, config=cfg, **kw) for w in ws])
        except Exception as e:  # a config that does not compile: report it, keep sweeping
            out["runs"].append({"config": label, "error": f"{type(e).__name__}: {e}"[:200]})
    ok = [r for r in out["runs"] if "us" in r and not r["config"].startswith(("cublas", "auto w"))]
    if ok:
        out["best"] = min(ok, key=lambda r: r["us"])
    del ws
    torch.cuda.empty_cache()
    return out


def bench_attention(ctx: int, configs: list[tuple[int, int, int]], layers: int,
                    cfg=QWEN3_4B, slots: int = 4097, dtype=torch.bfloat16) -> dict:
    """Decode attention at position ``ctx`` over ``layers`` distinct caches."""
    from qwen_trt.fast.kernels.attention import SPLIT, BLOCK_N, WARPS, _triton_attend, math_attend

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(cfg.heads, cfg.head_dim, generator=g, device="cuda").to(dtype)
    caches = [(torch.randn(cfg.kv_heads, slots, cfg.head_dim, generator=g, device="cuda",
                           dtype=dtype),
               torch.randn(cfg.kv_heads, slots, cfg.head_dim, generator=g, device="cuda",
                           dtype=dtype)) for _ in range(layers)]
    pos = torch.tensor([ctx], device="cuda")
    k0, v0 = caches[0]
    ref = math_attend(q.float(), k0.float(), v0.float(), pos,
                      torch.arange(slots, device="cuda")).float()
    out = {"ctx": ctx, "kv_MB_per_layer": round(2 * cfg.kv_heads * (ctx + 1) * cfg.head_dim
                                                 * q.element_size() / 1e6, 2), "runs": []}
    for split, block_n, warps in [(SPLIT, BLOCK_N, WARPS)] + configs:
        label = f"split={split} block_n={block_n} warps={warps}"
        try:
            got = _triton_attend(q, k0, v0, pos, split, block_n, warps).float()
            err = ((got - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                out["runs"].append({"config": label, "error": f"wrong result ({err:.2e})"})
                continue
            ms = time_graph(lambda: [_triton_attend(q, k, v, pos, split, block_n, warps)
                                     for k, v in caches])
            out["runs"].append({"config": label, "us": round(ms * 1e3 / layers, 2)})
        except Exception as e:
            out["runs"].append({"config": label, "error": f"{type(e).__name__}: {e}"[:200]})
    del caches
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="try every block configuration")
    ap.add_argument("--only", default=None, help="comma-separated shape names")
    ap.add_argument("--budget-s", type=float, default=400, help="stop sweeping after this")
    ap.add_argument("--programs", default="",
                    help="comma-separated grid sizes: sweep the persistent projections over "
                         "these exact program counts (block_n 1 and 2, the picked warps)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for name, spec in shapes().items():
        if args.only and args.only == "attention":
            break
        if args.only and name not in args.only.split(","):
            continue
        configs: list[GemvConfig | None] = [None]
        if args.sweep and time.perf_counter() - t0 < args.budget_s:
            bns = (4, 8, 16) if name == "lm_head" else (1, 2, 4, 8)
            configs += [GemvConfig(bn, 512, w, pk) for bn, w, pk in
                        itertools.product(bns, (4, 8), (512, 2048))]
            if name != "lm_head":
                configs += [GemvConfig(bn, 512, w, 8192, c) for bn, w, c in
                            itertools.product((1, 2, 4), (4, 8), (2, 4, 8))]
        if args.programs and name != "lm_head":
            auto = config_for(spec["rows"] // (2 if spec.get("gate_up") else 1), spec["k"],
                              spec.get("gate_up", False))
            configs += [GemvConfig(bn, 512, auto.warps, 8192, 0, int(p))
                        for p in args.programs.split(",") for bn in (1, 2)]
        r = bench_shape(name, spec, configs, QWEN3_4B.layers)
        result["shapes"][name] = r
        cub = r["runs"][0]
        if len(r["runs"]) > 1 and r["runs"][1]["config"] == "auto without PDL":
            print(f"{name:8s} without PDL {r['runs'][1].get('us')} us")
        best = r.get("best", {})
        print(f"{name:8s} {r['weight_MB']:7.1f} MB  cublas {cub['us']:7.2f} us "
              f"{cub['TBps']:.2f} TB/s  best {best.get('us', float('nan')):7.2f} us "
              f"{best.get('TBps', float('nan')):.2f} TB/s  {best.get('config')}", flush=True)
        if args.sweep:
            for run in sorted((x for x in r["runs"] if "us" in x), key=lambda x: x["us"])[:6]:
                print(f"      {run['us']:8.2f} us {run['TBps']:.2f} TB/s  {run['config']}")
            for run in r["runs"]:
                if "error" in run:
                    print(f"      error {run['config']}: {run['error']}")
    if not args.only or "attention" in args.only.split(","):
        combos = [(sp, bn, w) for sp, bn, w in itertools.product((32, 64, 128, 256), (32, 64),
                                                               (2, 4, 8)) if bn <= sp]
        for ctx in (128, 512, 2048):
            r = bench_attention(ctx, combos if args.sweep else [], QWEN3_4B.layers)
            result.setdefault("attention", []).append(r)
            ok = sorted((x for x in r["runs"] if "us" in x), key=lambda x: x["us"])
            print(f"attention ctx {ctx}: default {r['runs'][0].get('us')} us; best "
                  + "; ".join(f"{x['us']} us {x['config']}" for x in ok[:4]), flush=True)
            for run in r["runs"]:
                if "error" in run:
                    print(f"      error {run['config']}: {run['error']}")
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
