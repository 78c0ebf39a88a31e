"""Weight formats side by side on one GPU (bf16, FP8, INT4; random weights in Qwen3-4B shapes):

    python -m qwen_trt.bench.quant_bench --out results.json [--formats none,fp8,int4]

* ``kernels``: each projection shape at M = 1, 8, 32 rows (the batch-1 GEMV, the small-batch
  GEMM), µs per call and TB/s of the bytes the format stores, timed in CUDA graphs over enough
  weight copies that none is read from L2; with each kernel's relative error against the
  dequantized weights times the same activations (``F.linear``, float32 accumulate);
* ``decode``: per format, the batch-1 decoder (TTFT of a 512-token prompt, decode tok/s over
  256 new tokens, weights resident), then the batched runner's decode graph at 8 and 32 rows
  (graph ms per step, which projections won the warm-up timing), and the logits of the packed
  formats against bf16 over 512 teacher-forced positions (relative error, top-1 agreement).

Every section writes the JSON as it finishes, so a run cut short keeps what it measured.
Random weights say nothing about quality: they show the formats' rounding, not a model's loss.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from qwen_trt.bench.measure import graph_us
from qwen_trt.bench.qkernel_sweep import apply

# (N, K, gate_up, residual): the decode step's fusions, so the tuned configs are the step's
SHAPES_4B = {"qkv": (6144, 2560, False, False), "o": (2560, 4096, False, True),
             "gate_up": (19456, 2560, True, False), "down": (2560, 9728, False, True)}


def bench_kernels(fmt: str, rows=(1, 8, 32)) -> dict:
    import torch
    import torch.nn.functional as F

    from qwen_trt.fast.kernels.bgemm import bgemm
    from qwen_trt.fast.kernels.gemv import gemv
    from qwen_trt.fast.model.qformats import QuantSpec, packed_bytes, quantize
    from qwen_trt.fast.kernels.linear import dense

    out = {}
    for name, (n, k, gate_up, residual) in SHAPES_4B.items():
        torch.manual_seed(0)
        w0 = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        w = quantize(w0, QuantSpec(fmt)) if fmt != "none" else w0
        nbytes = packed_bytes(w)
        copies = max(2, -(-400_000_000 // nbytes))
        ws = [w] + [quantize(w0, QuantSpec(fmt)) if fmt != "none" else w0.clone()
                    for _ in range(copies - 1)]
        wd = dense(w, torch.bfloat16).float()
        for m in rows:
            x = (torch.randn(m, k, device="cuda")).to(torch.bfloat16)
            r = (torch.randn(m, n, device="cuda").to(torch.bfloat16) if residual else None)
            if m == 1:
                run = lambda i: gemv(ws[i], x.view(k), gate_up=gate_up,  # noqa: E731
                                     residual=None if r is None else r.view(n))
            else:
                run = lambda i: bgemm(ws[i], x, gate_up=gate_up, residual=r)  # noqa: E731
            got = run(0).float().reshape(m, -1)
            ref = F.linear(x.float(), wd)
            if gate_up:
                g, u = ref.chunk(2, dim=-1)
                ref = F.silu(g) * u
            if r is not None:
                ref = ref + r.float()
            err = ((got - ref).norm() / ref.norm()).item()
            us = graph_us(run, copies)
            out[f"{name}_M{m}"] = {"us": round(us, 2), "bytes": nbytes,
                                   "TBps": round(nbytes / us / 1e6, 3), "rel_err": err}
        del ws, w, w0, wd
        torch.cuda.empty_cache()
    return out


def all_logits(model, ids):
    """Logits of every position of a prompt (prefill math, dense weights)."""
    import torch.nn.functional as F

    from qwen_trt.fast.model.model import prefill_layer
    from qwen_trt.fast.kernels.linear import dense

    dt = model.dtype
    pos = __import__("torch").arange(ids.shape[0], device=ids.device)
    x = F.embedding(ids, model.embed)
    for i, layer in enumerate(model.layers):
        k_cache, v_cache = model.cache.kv(i)
        weights = (layer.ln_in, dense(layer.wqkv, dt), layer.q_norm, layer.k_norm,
                   dense(layer.wo, dt), layer.ln_post, dense(layer.w_gate_up, dt),
                   dense(layer.w_down, dt))
        x = prefill_layer(model.cfg, x, pos, model.cos, model.sin, weights, k_cache, v_cache)
    return model._logits(x)


def bench_format(fmt: str, prompt: list[int], new_tokens: int, ref_logits, log,
                 batched: bool = True) -> dict:
    import torch

    from qwen_trt.fast import SHAPES, load_fast_decoder
    from qwen_trt.fast.step.build import make_batched
    from qwen_trt.fast.step.graphs import replay_ms
    from qwen_trt.params import SamplingParams

    cfg = SHAPES["qwen3-4b"]
    res: dict = {}
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    dec = load_fast_decoder(cfg, weights=None, max_seq_len=1024, dtype=torch.bfloat16,
                            device="cuda", warmup=False, quantization=fmt)
    res["load_s"] = round(time.perf_counter() - t, 2)
    m = dec.model
    res["weights_GB"] = round(m.weight_bytes / 1e9, 3)
    res["resident_GB"] = round((torch.cuda.memory_allocated() - base) / 1e9, 3)
    res["kernels"], res["notes"] = dec.stats.kernels, list(dec.stats.notes)
    st = dec.warmup()
    res["warmup_s"] = round(st.warmup_s, 2)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    runs = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen = dec.generate(prompt, params)
        next(gen)
        t1 = time.perf_counter()
        n = sum(1 for _ in gen)
        t2 = time.perf_counter()
        runs.append({"ttft_ms": round((t1 - t0) * 1e3, 2), "decode_tok_s": round(n / (t2 - t1), 1)})
    res["batch1"] = runs
    log(f"[quant-bench] {fmt}: batch 1 {runs[-1]}")
    with torch.inference_mode():
        ids = torch.tensor(prompt, device="cuda")
        logits = all_logits(m, ids).float()
    if ref_logits is not None:
        err = ((logits - ref_logits).norm(dim=-1) / ref_logits.norm(dim=-1))
        top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        res["logits_vs_bf16"] = {"positions": int(ids.shape[0]),
                                 "rel_err_mean": round(err.mean().item(), 5),
                                 "rel_err_max": round(err.max().item(), 5),
                                 "top1_agree": round(top1, 4)}
    if not batched:
        del dec, m
        torch.cuda.empty_cache()
        return res, logits
    # the batched runner's decode graphs at 8 and 32 rows
    dec._decode_graphs.clear()
    dec._prefill_graphs.clear()
    bm = make_batched(m, kv_tokens=40 * 1024, checked=True, warmup=False)
    steps = {}
    bs = bm.block_size
    for b in (8, 32):
        g = bm._graph(b)
        ctx = 768
        per = -(-(ctx + 1) // bs)
        tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(b)]
        bm.decode_meta([5] * b, [ctx] * b, tables, b)
        ms = replay_ms(g, 20, warmup=3)
        steps[b] = {"graph_ms": round(ms, 3), "tok_s_graph_only": round(b * 1e3 / ms, 1),
                    "impl": bm.stats.bucket_impl.get(b), "timed": bm.stats.bucket_ms.get(b)}
    res["batched"] = steps
    log(f"[quant-bench] {fmt}: batched {steps}")
    del bm, dec, m
    torch.cuda.empty_cache()
    return res, logits


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.quant_bench")
    p.add_argument("--out", required=True)
    p.add_argument("--formats", default="none,fp8,int4")
    p.add_argument("--no-kernels", action="store_true")
    p.add_argument("--kernel-formats", default=None, help="default: --formats")
    p.add_argument("--no-batched", action="store_true", help="skip the 8/32-row decode graphs")
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--apply-sweep", default=None, metavar="SWEEP_JSON",
                   help="fill qkernels' tables from a qkernel_sweep result first")
    args = p.parse_args(argv)
    if args.apply_sweep:
        apply(args.apply_sweep)
    formats = [f for f in args.formats.split(",") if f]
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "gpu_uuid": str(getattr(torch.cuda.get_device_properties(0), "uuid", "")),
           "command": "python -m qwen_trt.bench.quant_bench " + " ".join(argv or sys.argv[1:]),
           "kernels": {}, "decode": {}}
    path = Path(args.out)

    def save():
        path.write_text(json.dumps(out, indent=1) + "\n")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if not args.no_decode:
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 150000, (512,), generator=g).tolist()
        ref = None
        for fmt in formats:
            try:
                res, logits = bench_format(fmt, prompt, args.new_tokens, ref, log,
                                           batched=not args.no_batched)
                if fmt == "none":
                    ref = logits
                out["decode"][fmt] = res
            except Exception as e:  # noqa: BLE001
                import traceback

                out["decode"][fmt] = {"error": f"{type(e).__name__}: {e}"[:400],
                                      "trace": traceback.format_exc()[-1500:]}
            save()
    if not args.no_kernels:   # after the decode runs: the kernels are tuned by then
        for fmt in (args.kernel_formats or args.formats).split(","):
            try:
                out["kernels"][fmt] = bench_kernels(fmt)
            except Exception as e:  # noqa: BLE001 - keep the other formats
                out["kernels"][fmt] = {"error": f"{type(e).__name__}: {e}"[:400]}
            log(f"[quant-bench] kernels {fmt}: {out['kernels'][fmt]}")
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
