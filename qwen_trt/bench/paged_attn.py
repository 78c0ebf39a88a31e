"""The batched decode attention alone: ``python -m qwen_trt.bench.paged_attn [--out F.json]``.

Times :func:`~qwen_trt.fast.kernels.paged_kernels.paged_rope_decode_attention` (the kernel pair of the
batched decode graphs) on random Qwen3-4B-shaped rows and cache, per (decode rows, context,
split, table width): a CUDA graph of ``--layers`` calls (one per layer, as in a
step), replayed, in microseconds per call and the K/V bytes it reads per second. The table width
is the graphs' (``--max-seq-len`` tokens: the grid covers every split of the widest row) or
``fit`` (just the context: what a grid sized to the batch would launch).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch


def _case(rows: int, ctx: int, split: int, width_tokens: int, layers: int,
          bs: int = 32, heads: int = 32, kvh: int = 8, d: int = 128) -> dict:
    from qwen_trt.fast.step.graphs import capture, replay_ms
    from qwen_trt.fast.kernels.paged_kernels import paged_rope_decode_attention

    dev = torch.device("cuda")
    dt = torch.bfloat16
    blocks_per_row = -(-ctx // bs)
    width = -(-width_tokens // bs)
    n_blocks = rows * blocks_per_row + 1
    g = torch.Generator(device=dev).manual_seed(0)
    kc = torch.randn(kvh, n_blocks * bs, d, generator=g, device=dev, dtype=dt)
    vc = torch.randn(kvh, n_blocks * bs, d, generator=g, device=dev, dtype=dt)
    qkv = torch.randn(rows, (heads + 2 * kvh) * d, generator=g, device=dev, dtype=dt)
    perm = torch.randperm(n_blocks - 1, generator=g, device=dev).to(torch.int32) + 1
    tables = torch.zeros(rows, width, dtype=torch.int32, device=dev)
    tables[:, :blocks_per_row] = perm[:rows * blocks_per_row].view(rows, blocks_per_row)
    lens = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
    pos = (lens - 1).long()
    slots = (tables[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs)
    qn = torch.ones(d, device=dev, dtype=dt)
    cos = torch.ones(ctx + 1, d, device=dev, dtype=dt)
    sin = torch.zeros(ctx + 1, d, device=dev, dtype=dt)
    def body():
        for _ in range(layers):
            paged_rope_decode_attention(qkv, qn, qn, cos, sin, pos, slots, kc, vc, tables,
                                        lens, bs, 1e-6, heads, split=split)

    graph = capture(body, lambda: None, None)
    ms = min(replay_ms(graph, 20, warmup=3) for _ in range(3))
    per_call_us = ms * 1e3 / layers
    kv_bytes = rows * ctx * kvh * d * 2 * 2
    return {"rows": rows, "ctx": ctx, "split": split, "width_tokens": width_tokens,
            "us_per_call": round(per_call_us, 2),
            "kv_tb_s": round(kv_bytes / (per_call_us * 1e-6) / 1e12, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.paged_attn",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--ctxs", default="512,1700")
    p.add_argument("--splits", default="64,128,256")
    p.add_argument("--max-seq-len", type=int, default=32768)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    res = []
    for rows in ints(a.rows):
        for ctx in ints(a.ctxs):
            for split in ints(a.splits):
                for width in (a.max_seq_len, "fit"):
                    w = ctx if width == "fit" else width
                    r = _case(rows, ctx, split, w, a.layers)
                    r["width"] = width
                    res.append(r)
                    print(json.dumps(r), file=sys.stderr, flush=True)
    out = {"tool": "qwen_trt.bench.paged_attn", "device": torch.cuda.get_device_name(),
           "cases": res}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
