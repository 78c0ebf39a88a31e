"""Where a decode step's time goes: ``python -m qwen_trt.fast.profile [--shape qwen3-4b]``.

Builds the fast decoder on random weights, times graph replays of one decode step with CUDA
events, then runs the same step without the graph under ``torch.profiler`` and prints
the GPU kernels grouped by name (time per step, share), so launch gaps and slow kernels show.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from qwen_trt.fast import SHAPES, load_fast_decoder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    ap.add_argument("--ctx", type=int, default=512, help="position of the decoded token")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None, help="write a JSON summary here")
    ap.add_argument("--kernels", default="auto", choices=("auto", "triton", "torch"))
    args = ap.parse_args(argv)
    cfg = SHAPES[args.shape]
    t = time.perf_counter()
    eng = load_fast_decoder(cfg, weights=None, max_seq_len=args.max_seq_len, dtype=torch.bfloat16,
                           device="cuda", warmup=False, kernels=args.kernels)
    load_s = time.perf_counter() - t
    stats = eng.warmup(kinds=("greedy",), prefill=False)
    kv = next(b for b in eng.kv_buckets if b > args.ctx)
    graph = eng._decode_graph(kv, "greedy")

    def set_pos() -> None:
        eng.pos.fill_(args.ctx)
        eng.sampler.step.zero_()

    set_pos()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        set_pos()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.steps):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / args.steps)
    step_ms = sorted(times)[len(times) // 2]
    wb = eng.model.weight_bytes
    res = {"kernels": stats.kernels, "attention": stats.attention, "notes": stats.notes,
           "load_s": round(load_s, 2), "warmup_s": round(stats.warmup_s, 2),
           "graph_step_ms": round(step_ms, 4), "tok_s": round(1e3 / step_ms, 1),
           "weight_GB": wb / 1e9, "achieved_TBps": round(wb / (step_ms / 1e3) / 1e12, 3),
           "kv_bucket": kv}

    from torch.profiler import ProfilerActivity, profile

    n_prof = 20
    with torch.inference_mode():
        for _ in range(3):
            set_pos()
            eng._decode_step(kv, "greedy")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n_prof):
                eng._decode_step(kv, "greedy")
            torch.cuda.synchronize()
    groups: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            groups.setdefault(ev.name, []).append(ev.device_time if hasattr(ev, "device_time")
                                                  else ev.cuda_time)
    total = sum(sum(v) for v in groups.values()) / n_prof
    rows = sorted(((sum(v) / n_prof, len(v) / n_prof, k) for k, v in groups.items()), reverse=True)
    res["kernels_per_step"] = round(sum(len(v) for v in groups.values()) / n_prof, 1)
    res["kernel_us_per_step"] = round(total, 1)
    res["top"] = [{"us": round(us, 1), "calls": c, "share": round(us / total, 3), "name": k[:90]}
                  for us, c, k in rows[:25]]
    print(json.dumps({k: v for k, v in res.items() if k != "top"}, indent=1))
    print(f"{'us/step':>9} {'calls':>6} {'share':>6}  kernel")
    for r in res["top"]:
        print(f"{r['us']:9.1f} {r['calls']:6.0f} {r['share']:6.1%}  {r['name']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
