"""Where a step's time goes: ``python -m qwen_trt.bench.profile [--shape qwen3-4b]``.

Builds the fast decoder on random weights, times graph replays of one decode step with CUDA
events, then runs the same step without the graph under ``torch.profiler`` and prints
the GPU kernels grouped by name (time per step, share), so launch gaps and slow kernels show.

``--variants "attn_preload=0;"`` times the decode step under each set of kernel options
(:class:`~qwen_trt.fast.options.KernelOptions` field names), round-robin in one process.

``--prefill 512,2048`` times the batch-1 decoder's prefill graphs and the first token (prefill +
choice + copy to the host, what TTFT measures on the GPU side) and lists the prefill's kernels;
with ``--variants`` it builds one decoder per variant (options in force when the decoder is built)
and times them round-robin.

``--step-tokens 512,1024`` does the same for the batched runner's steps that prefill: a fresh
prompt of N tokens, and N tokens = 8 decode rows + a chunk after a prefix of N tokens.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from qwen_trt.fast import SHAPES, FastDecoder, load_fast_decoder
from qwen_trt.fast.step.graphs import capture, replay_ms
from qwen_trt.fast.options import KernelOptions, options, use


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    ap.add_argument("--ctx", type=int, default=512, help="position of the decoded token")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None, help="write a JSON summary here")
    ap.add_argument("--kernels", default="auto", choices=("auto", "triton", "torch"))
    ap.add_argument("--step-tokens", default="",
                    help="comma-separated row counts: profile the batched steps that prefill")
    ap.add_argument("--variants", default="",
                    help="semicolon-separated variants, each a comma-separated list of "
                         "kernel options, NAME=VALUE (attn_preload=0, paged_split=64, "
                         "gemv.4096x2560=4:8:2; empty: as is): time the batch-1 decode step "
                         "under each, at --ctxs")
    ap.add_argument("--ctxs", default="512,2048", help="contexts for --variants")
    ap.add_argument("--prefill", default="",
                    help="comma-separated prompt lengths: profile the batch-1 prefill")
    args = ap.parse_args(argv)
    cfg = SHAPES[args.shape]
    if args.prefill:
        return profile_prefill(cfg, [int(x) for x in args.prefill.split(",")],
                               args.variants.split(";") if args.variants else [""], args)
    if args.variants:
        return profile_variants(cfg, args.variants.split(";"),
                                [int(x) for x in args.ctxs.split(",")], args)
    if args.step_tokens:
        return profile_steps(cfg, [int(x) for x in args.step_tokens.split(",")], args)
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
        times.append(replay_ms(graph, args.steps))
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
    res.update(kernel_table(prof, n_prof))
    print(json.dumps({k: v for k, v in res.items() if k != "top"}, indent=1))
    print(f"{'us/step':>9} {'calls':>6} {'share':>6}  kernel")
    _print_top(res["top"])
    _save(args.out, res)
    return 0


def _print_top(rows: list[dict]) -> None:
    for r in rows:
        print(f"{r['us']:9.1f} {r['calls']:6.0f} {r['share']:6.1%}  {r['name']}")


def _save(path: str | None, res: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


def kernel_table(prof, n: int, top: int = 25) -> dict:
    """GPU kernels of ``n`` profiled steps grouped by name: per-step time, calls, share."""
    groups: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            groups.setdefault(ev.name, []).append(ev.device_time if hasattr(ev, "device_time")
                                                  else ev.cuda_time)
    total = sum(sum(v) for v in groups.values()) / n
    rows = sorted(((sum(v) / n, len(v) / n, k) for k, v in groups.items()), reverse=True)
    return {"kernels_per_step": round(sum(len(v) for v in groups.values()) / n, 1),
            "kernel_us_per_step": round(total, 1),
            "top": [{"us": round(us, 1), "calls": c, "share": round(us / total, 3),
                     "name": k[:90]} for us, c, k in rows[:top]]}


def _env(variant: str) -> KernelOptions:
    """A variant: kernel option changes (``"attn_preload=0,paged_split=64"``) over the defaults."""
    try:
        return options().with_text(variant)
    except ValueError as e:
        raise SystemExit(f"--variants: {e}") from None


def _env_applied(opts: KernelOptions):
    """The kernel options ``opts`` in force inside the block."""
    return use(opts)


def profile_variants(cfg, variants: list[str], ctxs: list[int], args) -> int:
    """Graph replay time of the batch-1 decode step (Triton kernels + greedy argmax, position
    fixed at each context) under each variant (environment settings read when the kernels
    are launched, so each captured graph keeps its variant); the variants are timed
    round-robin so drift hits them alike, and each one's logits are compared with the
    first's (``logits_equal_first``; bit for bit) and its relative difference reported."""
    envs = {p: _env(p) for p in variants}      # a typo fails here, before the model is built
    t = time.perf_counter()
    eng = load_fast_decoder(cfg, weights=None, max_seq_len=args.max_seq_len,
                            dtype=torch.bfloat16, device="cuda", warmup=False, kernels="triton")
    m = eng.model
    out = {"load_s": round(time.perf_counter() - t, 2), "notes": eng.stats.notes,
           "weight_GB": m.weight_bytes / 1e9, "ctx": {}}
    tok = torch.ones(1, dtype=torch.long, device="cuda")
    graphs, logits, keep = {}, {}, []   # keep: the graphs' inputs stay allocated
    for p in variants:
        with _env_applied(envs[p]):
            for ctx in ctxs:
                pos = torch.tensor([ctx], device="cuda")
                buf = torch.empty(1, cfg.vocab_size, dtype=m.dtype, device="cuda")

                def step(pos=pos, buf=buf) -> None:
                    lg = m.decode(tok, pos, eng.positions)
                    buf.copy_(lg)
                    tok.copy_(lg.argmax(-1))

                with torch.inference_mode():
                    graphs[p, ctx] = capture(step, lambda: tok.fill_(1), eng._pool)
                logits[p, ctx] = buf
                keep.append(pos)
    for ctx in ctxs:
        times: dict[str, list[float]] = {p: [] for p in variants}
        for _ in range(7):
            for p in variants:
                g = graphs[p, ctx]
                tok.fill_(1)
                for _ in range(5):
                    g.replay()
                times[p].append(replay_ms(g, args.steps))
        rows = {}
        tok.fill_(1)
        graphs[variants[0], ctx].replay()
        torch.cuda.synchronize()
        first = logits[variants[0], ctx].clone()
        for p in variants:
            tok.fill_(1)
            graphs[p, ctx].replay()
            torch.cuda.synchronize()
            same = bool(torch.equal(logits[p, ctx], first))
            rel = ((logits[p, ctx].float() - first.float()).norm() / first.float().norm()).item()
            ms = sorted(times[p])[len(times[p]) // 2]
            rows[p] = {"step_ms": round(ms, 4), "tok_s": round(1e3 / ms, 1),
                       "min_ms": round(min(times[p]), 4), "logits_equal_first": same,
                       "logits_rel_diff_first": rel}
            print(f"ctx {ctx:5d}  {p:40s} {ms:.4f} ms  {1e3 / ms:6.1f} tok/s  "
                  f"(min {min(times[p]):.4f}){'' if same else f'  logits differ: {rel:.1e}'}")
        tok.fill_(1)
        graphs[variants[0], ctx].replay()
        torch.cuda.synchronize()
        rows["first_plan_repeatable"] = bool(torch.equal(first, logits[variants[0], ctx]))
        print(f"ctx {ctx:5d}  first plan repeatable: {rows['first_plan_repeatable']}")
        out["ctx"][str(ctx)] = rows
    _save(args.out, out)
    return 0


def profile_prefill(cfg, lengths: list[int], variants: list[str], args) -> int:
    """The batch-1 prefill at each length under each variant: graph replay ms (round-robin),
    first-token ms on the host (prefill graph + token choice + copy back), logits compared
    with the first variant's, and the prefill's kernels (compiled, not captured)."""
    from torch.profiler import ProfilerActivity, profile

    from qwen_trt.fast import build_model
    from qwen_trt.fast.model.weights import init_random
    from qwen_trt.params import SamplingParams

    envs = {p: _env(p) for p in variants}
    t = time.perf_counter()
    m = build_model(cfg, max_seq_len=args.max_seq_len, dtype=torch.bfloat16, device="cuda")
    init_random(m, seed=0)
    out: dict = {"load_s": round(time.perf_counter() - t, 2), "lengths": {}}
    decs = {}
    for p in variants:
        with _env_applied(envs[p]):
            dec = FastDecoder(m, kernels="triton")
            with torch.inference_mode():
                for n in lengths:
                    dec._prefill_graph(n)
        decs[p] = dec
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=1, temperature=0)
    for n in lengths:
        ids = torch.randint(1, cfg.vocab_size, (n,), generator=g)
        for dec in decs.values():
            dec.ids[:n].copy_(ids)
            dec.last.fill_(n - 1)
        times: dict[str, list[float]] = {p: [] for p in variants}
        first_tok: dict[str, list[float]] = {p: [] for p in variants}
        cold: dict[str, list[float]] = {p: [] for p in variants}
        host: dict[str, list[float]] = {"sampler_set": [], "ids_copy": []}
        prompt = ids.tolist()
        with torch.inference_mode():
            for _ in range(7):
                for p, dec in decs.items():
                    graph = dec._prefill_graphs[n]
                    dec.last.fill_(n - 1)
                    times[p].append(replay_ms(graph, max(5, args.steps // 10), warmup=2))
                    for _ in range(3):   # one replay from an idle GPU, as a request sees it
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        graph.replay()
                        torch.cuda.synchronize()
                        cold[p].append((time.perf_counter() - t0) * 1e3)
                    for _ in range(3):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        dec._start(prompt, params, "greedy")()
                        first_tok[p].append((time.perf_counter() - t0) * 1e3)
                    torch.cuda.synchronize()   # host-side cost of the steps before the graph
                    t0 = time.perf_counter()
                    dec.sampler.set(params)
                    t1 = time.perf_counter()
                    dec.ids[:n].copy_(torch.tensor(prompt, dtype=torch.long))
                    t2 = time.perf_counter()
                    host["sampler_set"].append((t1 - t0) * 1e3)
                    host["ids_copy"].append((t2 - t1) * 1e3)
        out.setdefault("host_ms", {})[str(n)] = {k: round(sorted(v)[len(v) // 2], 4)
                                                 for k, v in host.items()}
        print(f"prefill {n:5d}  host ms before the graph: {out['host_ms'][str(n)]}")
        rows: dict = {}
        ref = None
        for p, dec in decs.items():
            with torch.inference_mode():
                dec.last.fill_(n - 1)
                dec._prefill_graphs[n].replay()
            torch.cuda.synchronize()
            lg = dec.logits.float().clone()
            ref = lg if ref is None else ref
            rel = ((lg - ref).norm() / ref.norm()).item()
            ms = sorted(times[p])[len(times[p]) // 2]
            ft = sorted(first_tok[p])[len(first_tok[p]) // 2]
            cm = sorted(cold[p])[len(cold[p]) // 2]
            rows[p] = {"prefill_graph_ms": round(ms, 4), "idle_replay_ms": round(cm, 4),
                       "first_token_ms": round(ft, 3), "logits_rel_diff_first": rel}
            print(f"prefill {n:5d}  {p:40s} graph {ms:.4f} ms  from idle {cm:.4f} ms  "
                  f"first token {ft:.3f} ms"
                  f"{f'  logits differ: {rel:.1e}' if rel else ''}")
        for p, dec in decs.items():
            with torch.inference_mode():
                dec.last.fill_(n - 1)
                for _ in range(2):
                    dec._prefill_step(n)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        dec._prefill_step(n)
                    torch.cuda.synchronize()
            rows[p].update(kernel_table(prof, 3, top=14))
            print(f"prefill {n:5d}  {p}: kernels {rows[p]['kernel_us_per_step'] / 1e3:.3f} ms, "
                  f"{rows[p]['kernels_per_step']} per prefill")
            _print_top(rows[p]["top"])
        out["lengths"][str(n)] = rows
    _save(args.out, out)
    return 0


def profile_steps(cfg, sizes: list[int], args) -> int:
    """Graph replay time and the eager step's kernels for steps that prefill (see module)."""
    from torch.profiler import ProfilerActivity, profile

    from qwen_trt.fast import build_model
    from qwen_trt.fast.step.batched import SeqChunk
    from qwen_trt.fast.step.build import make_batched
    from qwen_trt.fast.model.weights import init_random
    from qwen_trt.serving.kv_blocks import BlockAllocator, SeqBlocks

    m = build_model(cfg, max_seq_len=args.max_seq_len, dtype=torch.bfloat16, device="cuda")
    init_random(m, seed=0)
    bm = make_batched(m, kv_tokens=64 * 1024)
    alloc = BlockAllocator(bm.cache.num_blocks, bm.block_size)
    g = torch.Generator().manual_seed(0)
    out = {"warmup_s": round(bm.stats.warmup_s, 2), "notes": bm.stats.notes, "steps": {}}

    def table(n: int) -> tuple[int, ...]:
        blocks = SeqBlocks()
        alloc.grow(blocks, n)
        return tuple(blocks.table)

    for n in sizes:
        toks = torch.randint(1, cfg.vocab_size, (2 * n,), generator=g).tolist()
        cases = {"fresh": (toks[:n], list(range(n)), [SeqChunk(0, n, n, table(n))], [n - 1])}
        t_pre = table(2 * n)
        bm.forward(toks[:n], list(range(n)), [SeqChunk(0, n, n, t_pre)], [n - 1])
        dec = [table(600) for _ in range(8)]
        k = n - 8
        cases["mixed"] = ([1] * 8 + toks[n:n + k], [512] * 8 + list(range(n, n + k)),
                          [SeqChunk(i, 1, 513, dec[i]) for i in range(8)]
                          + [SeqChunk(8, k, n + k, t_pre)], list(range(8)) + [n - 1])
        for name, case in cases.items():
            res = {}
            for mode in ("graph", "eager"):
                saved, bm.step_graphs = bm.step_graphs, bm.step_graphs and mode == "graph"
                try:
                    for _ in range(3):
                        bm.forward(*case)
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(10):
                        bm.forward(*case)
                    b.record()
                    b.synchronize()
                    res[f"{mode}_ms"] = round(a.elapsed_time(b) / 10, 3)
                    if mode == "eager":
                        with profile(activities=[ProfilerActivity.CUDA]) as prof:
                            for _ in range(3):
                                bm.forward(*case)
                            torch.cuda.synchronize()
                        res.update(kernel_table(prof, 3, top=12))
                finally:
                    bm.step_graphs = saved
            out["steps"][f"{name}_{n}"] = res
            print(f"{name} {n}: graph {res['graph_ms']} ms, eager {res['eager_ms']} ms, "
                  f"kernels {res['kernel_us_per_step'] / 1e3:.2f} ms")
            _print_top(res["top"])
    # the chained greedy decode graph of bucket 1 (a lone stream), replayed back to back:
    # the GPU's share of the batched runner's per-token time at c=1
    toks = torch.randint(1, cfg.vocab_size, (512,), generator=g).tolist()
    t1 = table(1024)
    bm.forward(toks, list(range(512)), [SeqChunk(0, 512, 512, t1)], [511])
    res = {}
    for b in (1, 8, 32):
        bm.decode_meta([1] * b, [512] * b, [t1] * b, b)
        graph = bm._fgraph(b, bm.width_for(612))
        for _ in range(5):
            graph.replay()
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        bm.decode_meta([1] * b, [512] * b, [t1] * b, b)
        a.record()
        for _ in range(100):     # positions advance on the device: 512 .. 611
            graph.replay()
        e.record()
        e.synchronize()
        res[f"bucket{b}_chained_ms"] = round(a.elapsed_time(e) / 100, 4)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            bm._fgraph(1, bm.width_for(612)).replay()
        torch.cuda.synchronize()
    res.update(kernel_table(prof, 10, top=12))
    out["decode"] = res
    print(f"decode chained graph: bucket 1 {res['bucket1_chained_ms']} ms, bucket 8 "
          f"{res['bucket8_chained_ms']} ms, bucket 32 {res['bucket32_chained_ms']} ms; "
          f"bucket 1 kernels {res['kernels_per_step']}/step")
    _print_top(res["top"])
    _save(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
