"""What a step that prefills costs by its size: ``python -m qwen_trt.bench.step_sizes --model DIR``.

Times :meth:`~qwen_trt.fast.step.batched.BatchedModel.forward` (the steps that prefill) for one prompt
chunk of ``n`` tokens, alone (a lone request's first step) and beside ``--decode-rows`` running
streams (an arrival in a closed loop), two ways: the captured graph of the token bucket that
holds the step (its padding rows cost compute) and the same step eagerly (the exact row count, a
launch per kernel); ``--pieces default,triton`` also with the step's norm/SiLU pieces as
Triton kernels (``QWEN_TRT_STEP_TRITON``). Milliseconds per step (CUDA events, median of
``--repeats``); JSON out. Its figures chose the token buckets (``STEP_TOKEN_BUCKETS``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _time(fn, repeats: int) -> float:
    fn()
    if not torch.cuda.is_available():            # a CPU shape check: wall time
        out = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return statistics.median(out)
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


PIECES = ("default", "triton")      # the step's norm/SiLU pieces: as the runner built them, or
#                                     batched._pre_triton / _post_triton (QWEN_TRT_STEP_TRITON)


def _use_pieces(bm, name: str, built: tuple) -> None:
    """The step's elementwise pieces ``name``; the step graphs are captured again on use."""
    if name == "triton":
        from qwen_trt.fast.step.batched import _post_triton, _pre_triton

        bm._pre, bm._post = _pre_triton, _post_triton
    else:
        bm._pre, bm._post = built
    if hasattr(bm, "_s_graphs"):
        bm._s_graphs.clear()


def _time_step(bm, n: int, dec_tables: list, decode_ctx: int, first_block: int,
               gen: torch.Generator, repeats: int) -> dict:
    """One step: a chunk of ``n`` new prompt tokens (in blocks from ``first_block`` on) beside
    a decode row per ``dec_tables`` entry, timed as its bucket's graph and eagerly."""
    from qwen_trt.fast.step.batched import STEP_TOKEN_BUCKETS, SeqChunk

    vocab = bm.cfg.vocab_size
    tokens, positions, chunks, logit_rows = [], [], [], []
    for t in dec_tables:
        chunks.append(SeqChunk(len(tokens), 1, decode_ctx + 1, t))
        logit_rows.append(len(tokens))
        tokens.append(int(torch.randint(vocab, (1,), generator=gen)))
        positions.append(decode_ctx)
    tab = tuple(range(first_block, first_block + -(-n // bm.block_size)))
    chunks.append(SeqChunk(len(tokens), n, n, tab))
    tokens += torch.randint(vocab, (n,), generator=gen).tolist()
    positions += list(range(n))
    logit_rows.append(len(tokens) - 1)

    def step():
        return bm.forward(tokens, positions, chunks, logit_rows)

    total = len(tokens)
    bucket = next((t for t in STEP_TOKEN_BUCKETS if t >= total), None)
    graph_ms = _time(step, repeats) if bm.step_graphs and bucket else None
    saved, bm.step_graphs = bm.step_graphs, False
    try:
        eager_ms = _time(step, repeats)
    finally:
        bm.step_graphs = saved
    return {"prefill_tokens": n, "decode_rows": len(dec_tables), "step_tokens": total,
            "bucket": bucket, "graph_ms": None if graph_ms is None else round(graph_ms, 3),
            "eager_ms": round(eager_ms, 3)}


def run(model: str, sizes: list[int], decode_rows: int, decode_ctx: int, repeats: int,
        log=print, device: str = "auto", pieces: tuple[str, ...] = ("default",)) -> dict:
    from qwen_trt.backends import BackendConfig
    from qwen_trt.fast.step.batched import STEP_TOKEN_BUCKETS
    from qwen_trt.serving.worker import WorkerSpec, load_for_spec, make_runner, resolve

    spec = WorkerSpec(BackendConfig(model=model, device=device, fast="on", max_batch=32))
    backend = load_for_spec(resolve(spec.loader), spec)
    runner = make_runner(backend, max_batch=32)
    bm = runner.model
    gen = torch.Generator().manual_seed(0)
    per_row = -(-(decode_ctx + 1) // bm.block_size)          # blocks of a decode row's context
    dec_tables = [tuple(range(1 + i * per_row, 1 + (i + 1) * per_row))
                  for i in range(decode_rows)]
    first_block = 1 + decode_rows * per_row                  # then every size's chunk
    rows: list[dict] = []
    built = (bm._pre, bm._post)
    for piece in pieces:
        _use_pieces(bm, piece, built)
        for n in sizes:
            for d in (0, decode_rows) if decode_rows else (0,):
                row = {"pieces": piece, **_time_step(bm, n, dec_tables[:d], decode_ctx,
                                                     first_block, gen, repeats)}
                rows.append(row)
                log(json.dumps(row))
    backend.close()
    return {"tool": "qwen_trt.bench.step_sizes", "model": model, "buckets": list(STEP_TOKEN_BUCKETS),
            "decode_ctx": decode_ctx, "repeats": repeats, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.step_sizes",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--sizes", default="128,256,384,512,640,700,768,900,1000")
    p.add_argument("--decode-rows", type=int, default=31)
    p.add_argument("--decode-ctx", type=int, default=700)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--pieces", default="default",
                   help="comma list of the step's norm/SiLU pieces: default (as built: "
                        "compiled), triton (bgemm's rms_rows / silu_mul_rows)")
    p.add_argument("--device", default="auto", help="cpu: a shape check on the tiny model")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    pieces = tuple(x.strip() for x in a.pieces.split(",") if x.strip())
    if not pieces or set(pieces) - set(PIECES):
        p.error(f"--pieces: a comma list of {', '.join(PIECES)}")
    res = run(a.model, [int(x) for x in a.sizes.split(",") if x.strip()], a.decode_rows,
              a.decode_ctx, a.repeats, log=lambda m: print(m, file=sys.stderr), device=a.device,
              pieces=pieces)
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
