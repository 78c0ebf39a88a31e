"""Where the batch-1 decoder parts from the eager float32 model (device diagnostic).

``PYTHONPATH=. python3 scripts/parity_diag.py [--out FILE.json]`` on a GPU. The prompts and
weights are those of tests/test_batched_cuda.py::test_tiny_float32_graphs_match_the_eager_model
(tiny Qwen3, float32, std 0.5). For each prompt and each decoder variant (Triton kernels with
graphs; no graphs/compile; the PyTorch decode; the math attention) it records the first token
that differs from the eager reference and the reference's top-2 logit gap there (a gap at
rounding level means a near-tie, not a wrong computation), and how far the variant's prefill
logits are from the reference's.
"""
from __future__ import annotations

import argparse
import json
import random

import torch

from qwen_trt.fast import TINY, FastDecoder, build_model
from qwen_trt.fast.model.weights import init_random
from qwen_trt.params import SamplingParams


def prompts(k, vocab, seed=0, lo=3, hi=300):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(k)]


def eager(m, prompt, n):
    """Reference tokens and the logits each was chosen from (prefill + PyTorch math decode)."""
    m.decode_impl, m.attn_impl = "torch", "math"
    kv_pos = torch.arange(m.max_seq_len + 1, device="cuda")
    toks, logits = [], []
    with torch.inference_mode():
        lg = m.prefill(torch.tensor(prompt, device="cuda"),
                       torch.tensor([len(prompt) - 1], device="cuda"))
        for i in range(n):
            logits.append(lg.float().squeeze(0).cpu())
            tok = lg.argmax(-1)
            toks.append(int(tok))
            if i + 1 < n:
                lg = m.decode(tok, torch.tensor([len(prompt) + i], device="cuda"), kv_pos)
    return toks, logits


def gap(lg):
    top = lg.topk(2).values
    return float(top[0] - top[1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--n", type=int, default=60)
    args = ap.parse_args()
    m = build_model(TINY, max_seq_len=1024, dtype=torch.float32, device="cuda")
    init_random(m, seed=1, std=0.5)
    ps = prompts(12, TINY.vocab_size, seed=3)
    ref = [eager(m, p, args.n) for p in ps]
    variants = {
        "triton+graphs": dict(),
        "triton, no graphs/compile": dict(compile=False, graphs=False),
        "triton, graphs, no compile": dict(compile=False),
        "torch decode": dict(kernels="torch"),
        "math attention": dict(attention="math"),
    }
    out = {}
    for name, kw in variants.items():
        dec = FastDecoder(m, **kw)
        rows = []
        for p, (rt, rl) in zip(ps, ref):
            got = list(dec.generate(p, SamplingParams(max_new_tokens=args.n, temperature=0,
                                                      ignore_eos=True)))
            first = next((i for i, (a, b) in enumerate(zip(got, rt)) if a != b), None)
            row = {"len": len(p), "first_diff": first}
            if first is not None:
                row["ref_gap"] = round(gap(rl[first]), 6)
                row["ref_top2"] = rl[first].topk(2).indices.tolist()
                row["got"] = got[first]
            # prefill alone: the decoder's prefill logits against the reference's
            with torch.inference_mode():
                dec._run_prefill(p)
                pl = dec.logits.float().squeeze(0).cpu()
            row["prefill_max_abs"] = float((pl - rl[0]).abs().max())
            row["prefill_rel"] = float((pl - rl[0]).norm() / rl[0].norm())
            rows.append(row)
        agree = sum(r["first_diff"] is None for r in rows)
        out[name] = {"agree": agree, "of": len(rows), "stats": dict(vars(dec.stats)),
                     "rows": rows}
        print(f"{name:30s} agree {agree}/{len(rows)}  kernels={dec.stats.kernels} "
              f"attention={dec.stats.attention}")
        for r in rows:
            if r["first_diff"] is not None:
                print("   ", r)
        print("    prefill rel err max", max(r["prefill_rel"] for r in rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
