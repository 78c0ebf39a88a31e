"""Sweep the packed-weight kernels' configurations on one GPU, against the bf16 kernels and
``torch._scaled_mm`` in the same process:

    python -m qwen_trt.bench.qkernel_sweep --out sweep.json [--jobs 12] [--shape tiny]
    python -m qwen_trt.bench.qkernel_sweep --out - --print-tables sweep.json

For each Qwen3-4B projection (qkv, o, gate/up, down, with the decode step's fusions) it times

* the batch-1 GEMV (M = 1): :func:`qwen_trt.fast.kernels.qkernels.qgemv` for FP8 and INT4 in every
  candidate configuration (the tensor-core ones: :mod:`qwen_trt.bench.qkernel_forms`), the bf16
  :func:`qwen_trt.fast.gemv.gemv`, cuBLAS (``F.linear``);
* the small-batch GEMM (M = 2, 8, 32): :func:`qwen_trt.fast.kernels.qkernels.qbgemm` for FP8, INT4 and
  dense bf16 in every candidate, the bf16 :func:`qwen_trt.fast.bgemm.bgemm` (autotuned), cuBLAS,
  and ``torch._scaled_mm`` with FP8 activations and row-wise scales (the stock FP8 GEMM, x
  quantized outside the timing);

in CUDA graphs over enough weight copies that none is read from L2, as µs per call and TB/s of
the bytes each format stores, each with its relative error against the dequantized weights
times the same activations. ``--jobs`` compiles every configuration in that many worker
processes first (Triton's disk cache), so the timed pass does not wait on compiles. The JSON is
written after each shape, so a run cut short keeps what it measured; ``best`` lists the fastest
configuration per (format, shape, rows).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from qwen_trt.bench.measure import graph_us

# name: (N, K, gate_up, residual, ln)
SHAPES = {
    "4b": {"qkv": (6144, 2560, False, False, True), "o": (2560, 4096, False, True, False),
           "gate_up": (19456, 2560, True, False, True), "down": (2560, 9728, False, True, False)},
    "tiny": {"qkv": (384, 256, False, False, True), "o": (256, 256, False, True, False),
             "gate_up": (1024, 256, True, False, True), "down": (256, 512, False, True, False)},
}
GEMM_ROWS = (8, 32)        # tuned row counts (block_m 16 and 32: M <= 16 uses M = 8's winner)


# (rows per block, warps, programs per SM, row blocks in flight) per format and shape: chosen
# from the registers ptxas reports for sm_90 (no spills; the programs that fit on an SM at
# that count, times the bytes of the blocks in flight, 20-60 KB per SM)
GEMV_CANDIDATES = {
    ("fp8", "qkv"): [(2, 4, 4, 2), (4, 8, 2, 2), (2, 4, 4, 1), (8, 8, 1, 2), (1, 4, 8, 2)],
    ("fp8", "o"): [(2, 4, 2, 2), (1, 4, 4, 2), (2, 4, 3, 1), (4, 8, 1, 2), (1, 4, 8, 1)],
    ("fp8", "gate_up"): [(2, 4, 2, 2), (1, 4, 4, 2), (2, 4, 3, 1), (4, 8, 1, 2), (1, 8, 2, 2)],
    ("fp8", "down"): [(1, 8, 2, 2), (1, 8, 2, 1), (1, 4, 2, 1), (2, 8, 1, 2), (1, 4, 4, 1)],
    # the inline-PTX forms (QConfig.asm; FP8 loads int32 words): fewer instructions per
    # weight and, for FP8, fewer registers (qkv 2 rows x 8 warps: 64), so more programs fit
    ("fp8-asm", "qkv"): [(2, 8, 4, 1), (2, 8, 4, 2), (4, 8, 2, 1), (1, 4, 8, 2), (2, 4, 4, 2)],
    ("fp8-asm", "o"): [(2, 8, 3, 2), (1, 4, 8, 2), (4, 8, 2, 1), (2, 8, 3, 1)],
    ("fp8-asm", "gate_up"): [(4, 8, 2, 1), (4, 8, 3, 1), (8, 8, 2, 1)],
    ("fp8-asm", "down"): [(2, 8, 1, 1), (2, 8, 2, 1), (4, 8, 1, 1)],
    # the FP8 GEMV with the block scales folded into the activations (QConfig.fold)
    # (first sweep: 4 x 8 x 2 won qkv and o; more bytes in flight per SM next)
    ("fp8-fold", "qkv"): [(4, 8, 2, 1), (4, 8, 3, 1), (4, 8, 4, 1), (8, 8, 2, 1), (8, 16, 1, 1),
                          (4, 8, 2, 2)],
    ("fp8-fold", "o"): [(4, 8, 2, 1), (4, 8, 3, 1), (4, 8, 4, 1), (8, 8, 2, 1), (4, 8, 2, 2)],
    ("fp8-fold", "gate_up"): [(4, 8, 2, 1), (4, 8, 3, 1), (8, 8, 2, 1), (4, 8, 2, 2),
                              (8, 16, 1, 1)],
    ("fp8-fold", "down"): [(2, 8, 2, 1), (2, 8, 3, 1), (4, 8, 2, 1), (4, 16, 1, 1), (2, 8, 2, 2)],
    # FP8 with the products in f16x2 (QConfig.half: ~3 SASS instructions a weight against the
    # folded kernel's 5-6, scripts/qkernel_sass.py), so more rows a block fit the issue rate;
    # registers for sm_90 at (rows, warps, ahead): qkv 8x8x1 95, 8x4x1 182, 4x4x1 95,
    # 8x8x2 119, 16x8x1 188; o 8x8x1 128, 4x4x1 128; gate_up 4x8x1 110, 8x8x1 145,
    # 4x8x2 128, 2x4x1 96; down 2x8x1 95, 4x8x1 177, 2x8x2 121
    ("fp8-half", "qkv"): [(8, 8, 2, 1), (8, 4, 2, 1), (4, 4, 4, 1), (8, 8, 2, 2), (16, 8, 1, 1),
                          (4, 8, 2, 1)],
    ("fp8-half", "o"): [(8, 8, 2, 1), (4, 4, 4, 1), (4, 8, 2, 1), (4, 4, 3, 1), (2, 4, 4, 1)],
    ("fp8-half", "gate_up"): [(4, 8, 2, 1), (8, 8, 1, 1), (4, 8, 2, 2), (2, 4, 4, 1),
                              (4, 4, 3, 1)],
    ("fp8-half", "down"): [(2, 8, 2, 1), (4, 8, 1, 1), (2, 8, 2, 2), (1, 8, 2, 1), (2, 4, 4, 1)],
    # INT4 in f16x2 (QConfig.half: int64 pairs of words, two nibbles a lop3 into 1024.0, the
    # zero point subtracted exactly in f16; 3.0-3.8 SASS instructions a weight at 8 rows
    # against 4.7-6.5 for the inline-PTX form); registers for sm_90: qkv 8x8 128, 8x4 168,
    # 4x8 80; o 8x8 128; gate_up 8x8 128, 4x4 128, 4x8 101; down 2x8 115, 4x8 167
    ("int4-half", "qkv"): [(8, 8, 2, 1), (8, 4, 2, 1), (4, 8, 2, 1), (8, 8, 2, 2)],
    ("int4-half", "o"): [(8, 8, 2, 1), (8, 4, 2, 1), (4, 8, 2, 1), (8, 8, 1, 2)],
    ("int4-half", "gate_up"): [(8, 8, 2, 1), (4, 4, 3, 1), (4, 8, 2, 1), (8, 8, 1, 1)],
    ("int4-half", "down"): [(4, 8, 1, 1), (2, 8, 2, 1), (4, 4, 2, 1), (2, 8, 2, 2)],
    ("int4-asm", "qkv"): [(4, 8, 2, 2), (8, 8, 2, 2), (16, 16, 1, 2), (8, 16, 1, 2)],
    ("int4-asm", "o"): [(4, 8, 2, 2), (16, 8, 2, 1), (8, 8, 2, 2), (16, 16, 1, 2)],
    ("int4-asm", "gate_up"): [(4, 8, 2, 2), (8, 8, 2, 2), (8, 16, 1, 2)],
    ("int4-asm", "down"): [(2, 8, 1, 2), (4, 8, 2, 2), (4, 16, 1, 2), (2, 8, 2, 2)],
    ("int4", "qkv"): [(4, 4, 3, 2), (2, 4, 4, 2), (8, 8, 1, 2), (4, 8, 2, 2), (4, 4, 4, 1)],
    ("int4", "o"): [(16, 8, 2, 1), (16, 8, 2, 2), (8, 8, 1, 2), (4, 4, 2, 2), (2, 4, 4, 2)],
    ("int4", "gate_up"): [(4, 4, 2, 2), (2, 4, 4, 2), (8, 8, 1, 2), (4, 8, 1, 2), (2, 4, 3, 1)],
    ("int4", "down"): [(1, 4, 3, 2), (2, 8, 1, 2), (1, 8, 2, 2), (2, 4, 2, 2), (1, 4, 4, 1)],
}

# The tensor-core GEMV (QConfig.dot, issue 26: bytes in flight): (rows per block, warps,
# columns per pipeline stage, stages, programs along K, steps prefetched into L2 before the
# PDL wait). 64-row blocks run wgmma (A, the upcast weights, from registers), 16/32-row ones
# mma.sync; Triton copies each stage's weights to shared memory asynchronously, so a program
# has ``stages - 1`` stages in flight (64 x 128 FP8 bytes x 3 = 24 KB) without holding them in
# registers, and ~40 KB of shared memory lets several programs share an SM. Grids of
# 150-320 programs for 132 SMs; split > 1 adds the small partial-sum kernel.
DOT_CANDIDATES = {
    ("fp8", "qkv"): [(64, 4, 128, 4, 2, 0), (64, 4, 128, 4, 2, 2), (64, 4, 256, 3, 2, 0),
                     (32, 4, 256, 4, 1, 0), (128, 8, 128, 4, 4, 0), (64, 4, 128, 5, 1, 2)],
    ("fp8", "o"): [(64, 4, 128, 4, 4, 0), (64, 4, 128, 4, 4, 2), (64, 4, 128, 3, 8, 0),
                   (32, 4, 128, 4, 4, 0), (64, 4, 256, 3, 4, 0), (128, 8, 128, 4, 8, 0)],
    ("fp8", "gate_up"): [(64, 4, 128, 4, 1, 0), (64, 4, 128, 4, 1, 2), (64, 4, 128, 3, 1, 0),
                         (32, 4, 128, 4, 1, 0), (64, 4, 128, 4, 2, 0), (64, 8, 256, 3, 1, 0)],
    ("fp8", "down"): [(64, 4, 128, 4, 4, 0), (64, 4, 128, 4, 4, 2), (64, 4, 256, 4, 4, 0),
                      (64, 4, 128, 4, 8, 0), (32, 4, 256, 4, 4, 0), (128, 8, 128, 4, 8, 0)],
    ("int4", "qkv"): [(64, 4, 256, 4, 2, 0), (64, 4, 256, 4, 2, 2), (64, 4, 512, 3, 2, 0),
                      (32, 4, 512, 3, 1, 0), (128, 8, 256, 3, 2, 0)],
    ("int4", "o"): [(64, 4, 256, 4, 4, 0), (64, 4, 256, 4, 4, 2), (64, 4, 256, 3, 8, 0),
                    (32, 4, 256, 4, 4, 0), (128, 8, 256, 4, 4, 0)],
    ("int4", "gate_up"): [(64, 4, 256, 4, 1, 0), (64, 4, 256, 4, 1, 2), (64, 4, 128, 4, 2, 0),
                          (32, 4, 256, 4, 1, 0), (64, 8, 256, 3, 1, 0)],
    ("int4", "down"): [(64, 4, 256, 4, 4, 0), (64, 4, 256, 4, 4, 2), (64, 4, 512, 3, 4, 0),
                       (64, 4, 256, 4, 8, 0), (32, 4, 256, 4, 4, 0)],
}


def gemv_candidates(fmt: str, shape: str) -> list[dict]:
    cands = [(c, False) for c in GEMV_CANDIDATES.get((fmt, shape), [(2, 4, 2, 1), (1, 4, 4, 2)])]
    cands += [(c, True) for c in GEMV_CANDIDATES.get((fmt + "-asm", shape), [])]
    cands += [(c, "fold") for c in GEMV_CANDIDATES.get((fmt + "-fold", shape), [])]
    cands += [(c, "half") for c in GEMV_CANDIDATES.get((fmt + "-half", shape), [])]
    out = [dict({"block_n": bn, "warps": w, "ctas_per_sm": c, "ahead": a},
                **({asm: True} if asm in ("fold", "half") else {"asm": True} if asm else {}))
           for (bn, w, c, a), asm in cands]
    out += [{"block_n": bn, "warps": w, "bk": bk, "stages": st, "split": sp, "dot": True,
             **({"l2pre": pre} if pre else {})}
            for bn, w, bk, st, sp, pre in DOT_CANDIDATES.get((fmt, shape), [])]
    return out


def auto_split(n: int, k: int, bn: int, step: int = 128, target: int = 264) -> int:
    strips = -(-n // bn)
    steps = -(-k // step)
    split = 1
    while strips * split < target and steps // (split * 2) >= 4:
        split *= 2
    return split


def gemm_candidates(fmt: str, n: int, k: int) -> list[dict]:
    out = []
    for bn, warps, stages, prefetch, split in ((64, 4, 3, False, None), (64, 4, 4, False, None),
                                               (32, 4, 3, False, None), (64, 4, 1, True, None)):
        c = {"block_n": bn, "warps": warps, "stages": stages, "prefetch": prefetch,
             "split": split if split is not None else auto_split(n, k, bn)}
        if c not in out:
            out.append(c)
    return out


def _table_cfg(it: dict, shape_set: str) -> dict | None:
    """The committed GEMV_TABLE configuration of a ``qgemv`` item's shape, as sweep keys."""
    from dataclasses import fields

    from qwen_trt.fast.kernels import qkernels as Q

    n, k, gate_up, _r, _ln = SHAPES[shape_set][it["shape"]]
    fmt = Q.FMT_FP8 if it["fmt"] == "fp8" else Q.FMT_INT4
    c = Q.gemv_config(fmt, n // 2 if gate_up else n, k, gate_up)
    base = Q.QConfig()
    return {f.name: getattr(c, f.name) for f in fields(c)
            if getattr(c, f.name) != getattr(base, f.name)}


def items(shape_set: str, only: str = "", vs_table: bool = False,
          probe: bool = False) -> list[dict]:
    """Every (kind, format, shape, rows, config) the sweep times, in a fixed order (``only``:
    comma-separated ``kind`` or ``kind:fmt`` filters, e.g. ``qgemv:fp8,gemv``; ``vs_table``:
    of the batch-1 packed GEMV only the tensor-core candidates and the committed table's
    configuration, so a sweep's winner is never slower than what is committed; ``probe``:
    see :func:`probe_items`)."""
    out = probe_items(shape_set) if probe else _items(shape_set)
    if vs_table:
        from qwen_trt.fast.kernels import qkernels as Q

        def keep(it):
            if it["kind"] != "qgemv" or it["cfg"].get("dot"):
                return True
            return Q.QConfig(**it["cfg"]) == Q.QConfig(**_table_cfg(it, shape_set))
        kept = [it for it in out if keep(it)]
        # the table's configuration when no candidate equals it (e.g. a default)
        for it in out:
            if it["kind"] == "qgemv" and not any(
                    o["kind"] == "qgemv" and o["shape"] == it["shape"]
                    and o["fmt"] == it["fmt"] and not o["cfg"].get("dot") for o in kept):
                kept.insert(kept.index(next(o for o in kept if o["shape"] == it["shape"])),
                            dict(it, cfg=_table_cfg(it, shape_set)))
        out = kept
    if not only:
        return out
    keys = [f.split(":") for f in only.split(",") if f]
    return [it for it in out
            if any(it["kind"] == k[0] and (len(k) == 1 or it["fmt"] == k[1]) for k in keys)]


def probe_items(shape_set: str) -> list[dict]:
    """The diagnostic of where a packed GEMV's time goes: per shape, the bf16 GEMV, and for
    FP8 (the folded kernel) and INT4 the committed configuration (FP8: the same rows, warps and
    programs folded, where the table's is not) beside the same kernel with ``probe`` (the
    same loads, one multiply a 32-bit word instead of unpacking 4 or 8 weights). If the probe
    is much faster, the kernel is bound by its arithmetic; if not, by its memory stream."""
    out = []
    for name in SHAPES[shape_set]:
        out.append({"shape": name, "kind": "gemv", "fmt": "none", "m": 1})
        for fmt in ("fp8", "int4"):
            it = {"shape": name, "kind": "qgemv", "fmt": fmt, "m": 1}
            cfg = _table_cfg(it, shape_set)
            if fmt == "fp8" and not cfg.get("fold"):
                cfg = {a: b for a, b in cfg.items() if a != "asm"} | {"fold": True}
                out.append(dict(it, cfg=_table_cfg(it, shape_set)))
            out.append(dict(it, cfg=cfg))
            out.append(dict(it, cfg=cfg | {"probe": True}))
    return out


def _items(shape_set: str) -> list[dict]:
    out = []
    for name, (n, k, gate_up, residual, ln) in SHAPES[shape_set].items():
        nout = n // 2 if gate_up else n
        for fmt in ("fp8", "int4"):
            for c in gemv_candidates(fmt, name):
                out.append({"shape": name, "kind": "qgemv", "fmt": fmt, "m": 1, "cfg": c})
        out.append({"shape": name, "kind": "gemv", "fmt": "none", "m": 1})
        out.append({"shape": name, "kind": "cublas", "fmt": "none", "m": 1})
        for m in GEMM_ROWS:
            for fmt in ("fp8", "int4", "none"):
                for c in gemm_candidates(fmt, nout, k):
                    out.append({"shape": name, "kind": "qbgemm", "fmt": fmt, "m": m, "cfg": c})
        for m in GEMM_ROWS:
            out.append({"shape": name, "kind": "bgemm", "fmt": "none", "m": m})
            out.append({"shape": name, "kind": "cublas", "fmt": "none", "m": m})
            out.append({"shape": name, "kind": "scaled_mm", "fmt": "fp8-rowwise", "m": m})
        out.append({"shape": name, "kind": "scaled_mm", "fmt": "fp8-rowwise", "m": 1})
    return out


class Shape:
    """One projection's weights in every format (``copies`` of each for the timed pass)."""

    def __init__(self, spec, device, copies_bytes: int):
        import torch

        from qwen_trt.fast.model.qformats import QuantSpec, quantize

        self.n, self.k, self.gate_up, self.residual, self.ln = spec
        n, k = self.n, self.k
        torch.manual_seed(0)
        self.w0 = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
        self.group = 128 if k % 128 == 0 else 64
        self.packed = {"fp8": quantize(self.w0, QuantSpec("fp8")),
                       "int4": quantize(self.w0, QuantSpec("int4", group=self.group)),
                       "none": self.w0}
        self.copies_bytes = copies_bytes
        self._copies: dict = {}
        self.device = device

    def copies(self, fmt: str) -> list:
        from qwen_trt.fast.model.qformats import QuantSpec, packed_bytes, quantize

        if fmt not in self._copies:
            w = self.packed[fmt]
            count = max(2, -(-self.copies_bytes // packed_bytes(w)))
            self._copies[fmt] = [w] + [
                (self.w0.clone() if fmt == "none"
                 else quantize(self.w0, QuantSpec(fmt, group=self.group)))
                for _ in range(count - 1)]
        return self._copies[fmt]

    def drop(self) -> None:
        self._copies.clear()


def _scaled_mm_setup(sh, m):
    """FP8 activations and weights with row-wise scales for ``torch._scaled_mm``."""
    import torch

    x = torch.randn(m, sh.k, device=sh.device).to(torch.bfloat16)
    xs = (x.float().abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-12)
    xq = (x.float() / xs).to(torch.float8_e4m3fn)
    w = sh.w0.float()
    ws = (w.abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-12)
    wq = (w / ws).to(torch.float8_e4m3fn)
    return x, xq, xs, wq, ws


def run_item(it: dict, sh: Shape, timed: bool) -> dict:
    """Launch (and with ``timed`` time) one item; returns µs, TB/s and the error."""
    import torch
    import torch.nn.functional as F

    from qwen_trt.fast.kernels import qkernels as Q
    from qwen_trt.fast.kernels.bgemm import bgemm
    from qwen_trt.fast.kernels.gemv import gemv
    from qwen_trt.fast.model.qformats import packed_bytes
    from qwen_trt.fast.kernels.linear import dense

    m, kind, fmt = it["m"], it["kind"], it["fmt"]
    n, k, gate_up = sh.n, sh.k, sh.gate_up
    nout = n // 2 if gate_up else n
    g = torch.Generator(device=sh.device).manual_seed(1)
    x = torch.randn(m, k, device=sh.device, generator=g).to(torch.bfloat16)
    r = (torch.randn(m, nout, device=sh.device, generator=g).to(torch.bfloat16)
         if sh.residual else None)
    ln = ((1 + 0.1 * torch.randn(k, device=sh.device, generator=g)).to(torch.bfloat16)
          if sh.ln and m == 1 else None)
    fused = kind in ("qgemv", "gemv", "qbgemm", "bgemm")
    if kind == "scaled_mm":
        if sh.device.type != "cuda":
            return {"skipped": "no cuda"}
        x, xq, xs, wq, ws = _scaled_mm_setup(sh, m)
        ws_t = ws.t().contiguous()
        copies = [wq] + [wq.clone() for _ in range(max(1, -(-sh.copies_bytes // wq.numel())) - 1)]
        nbytes = wq.numel()

        def call(i):
            return torch._scaled_mm(xq, copies[i].t(), scale_a=xs, scale_b=ws_t,
                                    out_dtype=torch.bfloat16)
        wd = (wq.float() * ws)
        fused = False
    else:
        cfg = Q.QConfig(**it["cfg"]) if "cfg" in it else None
        ws_ = sh.copies(fmt if kind != "cublas" else "none") if timed else [sh.packed[fmt]]
        nbytes = packed_bytes(ws_[0])
        wd = dense(sh.packed[fmt], torch.bfloat16).float()
        xv, rv = x.view(k) if m == 1 else x, (r.view(nout) if (r is not None and m == 1) else r)
        if kind == "qgemv":
            from qwen_trt.bench.qkernel_forms import dq_gemv
            qgemv = dq_gemv if cfg is not None and cfg.dot else Q.qgemv

            def call(i):
                return qgemv(ws_[i], xv, ln=ln, eps=1e-6, residual=rv, gate_up=gate_up,
                             config=cfg)
        elif kind == "gemv":
            def call(i):
                return gemv(ws_[i], xv, ln=ln, eps=1e-6, residual=rv, gate_up=gate_up)
        elif kind == "qbgemm":
            def call(i):
                return Q.qbgemm(ws_[i], x, residual=r, gate_up=gate_up, config=cfg)
        elif kind == "bgemm":
            def call(i):
                return bgemm(ws_[i], x, residual=r, gate_up=gate_up)
        else:   # cuBLAS, the plain projection (no fusions)
            def call(i):
                return F.linear(x, ws_[i])
    got = call(0).float().reshape(m, -1)
    res = {"bytes": nbytes}
    if fused:
        xr = x.float()
        if ln is not None:
            from qwen_trt.fast.model.reference import rms_norm
            xr = rms_norm(x, ln, 1e-6).float()
        ref = F.linear(xr, wd)
        if gate_up:
            a, b = ref.chunk(2, dim=-1)
            ref = F.silu(a) * b
        if r is not None:
            ref = ref + r.float()
    else:
        ref = F.linear(x.float(), wd)
    res["rel_err"] = round(((got - ref).norm() / ref.norm()).item(), 6)
    if timed and sh.device.type == "cuda":
        n_calls = len(copies) if kind == "scaled_mm" else len(ws_)
        us = graph_us(call, n_calls)
        res.update(us=round(us, 2), TBps=round(nbytes / us / 1e6, 3))
    return res


def keep_best(best: dict, it: dict, r: dict) -> None:
    """Record item ``it``'s result ``r`` in ``best`` (per shape, kind, format and rows) when it
    is the fastest so far among results within the error bound; a probe (``probe_items``,
    wrong results by design) never counts."""
    key = f"{it['shape']}|{it['kind']}|{it['fmt']}|M{it['m']}"
    b = best.setdefault(key, None)
    if ("us" in r and r.get("rel_err", 1) < 2e-2 and not (it.get("cfg") or {}).get("probe")
            and (b is None or r["us"] < b["us"])):
        best[key] = dict(us=r["us"], TBps=r["TBps"], cfg=it.get("cfg"))


def _key(it: dict) -> str:
    cfg = it.get("cfg")
    c = "" if cfg is None else ":" + ",".join(f"{a}={b}" for a, b in cfg.items())
    return f"{it['shape']}|{it['kind']}|{it['fmt']}|M{it['m']}{c}"


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """TB/s of a device-to-device copy (bytes read + written), the roofline's bandwidth."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        b.copy_(a)
    e.record()
    e.synchronize()
    return round(2 * nbytes * reps / (s.elapsed_time(e) * 1e-3) / 1e12, 3)


def tables(sweep: dict, shape_set: str = "4b") -> tuple[dict, dict]:
    """The fastest configurations of a sweep's ``best`` as ``(GEMV_TABLE, GEMM_TABLE)``
    entries of :mod:`qwen_trt.fast.kernels.qkernels`; a dense shape enters the GEMM table only where
    the split-K form beat the bf16 ``bgemm``, and a tensor-core (``dot``) winner never enters
    the GEMV table (``qgemv`` does not run that form: :mod:`qwen_trt.bench.qkernel_forms`;
    the committed entry stays)."""
    from qwen_trt.fast.kernels import qkernels as Q

    fmts = {"fp8": Q.FMT_FP8, "int4": Q.FMT_INT4, "none": Q.FMT_DENSE}
    best = sweep.get("best", {})
    gemv, gemm = {}, {}
    for name, (n, k, gate_up, _res, _ln) in SHAPES[shape_set].items():
        nout = n // 2 if gate_up else n
        for fmt in ("fp8", "int4"):
            b = best.get(f"{name}|qgemv|{fmt}|M1")
            if b and b.get("cfg") and not b["cfg"].get("dot"):
                gemv[(fmts[fmt], nout, k, gate_up)] = Q.QConfig(**b["cfg"])
        for m in GEMM_ROWS:
            for fmt in ("fp8", "int4", "none"):
                b = best.get(f"{name}|qbgemm|{fmt}|M{m}")
                if not (b and b.get("cfg")):
                    continue
                if fmt == "none":
                    base = best.get(f"{name}|bgemm|none|M{m}")
                    if base and base["us"] <= b["us"]:
                        continue
                gemm[(fmts[fmt], nout, k, max(16, m))] = Q.QConfig(**b["cfg"])
    return gemv, gemm


def merged(*sweeps: dict) -> dict:
    """One sweep's ``best`` from several (later ones win for the keys they timed; e.g. a
    GEMV-only ``--only qgemv`` sweep on top of a full one)."""
    best: dict = {}
    for sw in sweeps:
        best.update({k: v for k, v in sw.get("best", {}).items() if v})
    return {"best": best}


def table_source(sweep: dict, shape_set: str = "4b") -> str:
    """The entries of :func:`tables` as the Python lines of ``qkernels``' tables."""
    from qwen_trt.fast.kernels import qkernels as Q

    names = {Q.FMT_FP8: "FMT_FP8", Q.FMT_INT4: "FMT_INT4", Q.FMT_DENSE: "FMT_DENSE"}
    gemv, gemm = tables(sweep, shape_set)
    lines = ["GEMV_TABLE = {"]
    for (f, n, k, gu), c in gemv.items():
        asm = ((", asm=True" if c.asm else "") + (", fold=True" if c.fold else "")
               + (", half=True" if c.half else ""))
        lines.append(f"    ({names[f]}, {n}, {k}, {gu}): QConfig({c.block_n}, {c.warps}, "
                     f"{c.ctas_per_sm}, ahead={c.ahead}{asm}),")
    lines += ["}", "GEMM_TABLE = {"]
    for (f, n, k, bm), c in gemm.items():
        pre = ", prefetch=True" if c.prefetch else ""
        lines.append(f"    ({names[f]}, {n}, {k}, {bm}): QConfig({c.block_n}, {c.warps}, "
                     f"stages={c.stages}, split={c.split}{pre}),")
    return "\n".join(lines + ["}"])


def apply(path: str, shape_set: str = "4b") -> tuple[dict, dict]:
    """Fill :mod:`qwen_trt.fast.kernels.qkernels`' tables from a sweep's JSON (before any launch)."""
    from qwen_trt.fast.kernels import qkernels as Q

    gemv, gemm = tables(json.loads(Path(path).read_text()), shape_set)
    Q.GEMV_TABLE.update(gemv)
    Q.GEMM_TABLE.update(gemm)
    print(f"[sweep] applied {len(gemv)} GEMV and {len(gemm)} GEMM configurations",
          file=sys.stderr, flush=True)
    return gemv, gemm


def compile_part(shape_set: str, part: int, parts: int, device: str, only: str = "",
                 vs_table: bool = False, probe: bool = False) -> None:
    """Worker: launch every ``parts``-th item once (compiles into Triton's cache)."""
    import torch

    its = [it for i, it in enumerate(items(shape_set, only, vs_table, probe))
           if i % parts == part]
    shapes = {}
    for it in its:
        if it["shape"] not in shapes:
            shapes[it["shape"]] = Shape(SHAPES[shape_set][it["shape"]], torch.device(device),
                                        0)
        try:
            run_item(it, shapes[it["shape"]], timed=False)
        except Exception as e:  # noqa: BLE001 - the timed pass records the error
            print(f"[sweep] compile {_key(it)}: {type(e).__name__}: {e}"[:300], file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.qkernel_sweep")
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="4b", choices=sorted(SHAPES))
    p.add_argument("--jobs", type=int, default=0, help="compile in this many processes first")
    p.add_argument("--device", default="cuda")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)   # i/n: a compile worker
    p.add_argument("--copies-mb", type=int, default=300)
    p.add_argument("--only", default="", help="kind[:fmt],... filters (e.g. qgemv:fp8,gemv)")
    p.add_argument("--compile-timeout", type=int, default=150)
    p.add_argument("--vs-table", action="store_true",
                   help="batch-1 packed GEMV: only the tensor-core candidates and the committed "
                        "table's configurations")
    p.add_argument("--probe", action="store_true",
                   help="only the diagnostic items (probe_items): is a packed GEMV bound by "
                        "its arithmetic or by its memory stream")
    p.add_argument("--print-tables", metavar="SWEEP_JSON",
                   help="print a finished sweep's winners as qkernels' table entries, then exit")
    args = p.parse_args(argv)
    if args.print_tables:
        print(table_source(json.loads(Path(args.print_tables).read_text()), args.shape))
        return 0
    if args.part:
        i, n = (int(v) for v in args.part.split("/"))
        compile_part(args.shape, i, n, args.device, args.only, args.vs_table, args.probe)
        return 0
    import torch

    dev = torch.device(args.device)
    out = {"command": "python -m qwen_trt.bench.qkernel_sweep " + " ".join(argv or sys.argv[1:]),
           "results": {}, "best": {}}
    if dev.type == "cuda":
        out.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   gpu_uuid=str(getattr(torch.cuda.get_device_properties(0), "uuid", "")))
    path = Path(args.out)

    def save():
        path.write_text(json.dumps(out, indent=1) + "\n")

    t0 = time.perf_counter()
    if dev.type == "cuda":
        out["copy_TBps"] = copy_bandwidth()
    if args.jobs > 0:
        procs = [subprocess.Popen([sys.executable, "-m", "qwen_trt.bench.qkernel_sweep",
                                   "--out", "/dev/null", "--shape", args.shape, "--device",
                                   args.device, "--part", f"{i}/{args.jobs}",
                                   "--only", args.only]
                                  + (["--vs-table"] if args.vs_table else [])
                                  + (["--probe"] if args.probe else []))
                 for i in range(args.jobs)]
        deadline = time.monotonic() + args.compile_timeout
        for pr in procs:
            try:
                pr.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pr.kill()
        out["compile_s"] = round(time.perf_counter() - t0, 1)
        print(f"[sweep] compiled in {out['compile_s']} s", file=sys.stderr, flush=True)
    by_shape: dict[str, list] = {}
    for it in items(args.shape, args.only, args.vs_table, args.probe):
        by_shape.setdefault(it["shape"], []).append(it)
    for name, its in by_shape.items():
        sh = Shape(SHAPES[args.shape][name], dev, args.copies_mb * 1_000_000)
        for it in its:
            try:
                r = run_item(it, sh, timed=True)
            except Exception as e:  # noqa: BLE001 - keep the other configurations
                r = {"error": f"{type(e).__name__}: {e}"[:300]}
            out["results"][_key(it)] = r
            keep_best(out["best"], it, r)
        sh.drop()
        del sh
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        out["elapsed_s"] = round(time.perf_counter() - t0, 1)
        save()
        print(f"[sweep] {name} done at {out['elapsed_s']} s", file=sys.stderr, flush=True)
    if dev.type == "cuda":
        out["registers"] = compiled_registers()
    save()
    return 0


def compiled_registers() -> list:
    """Registers and spills of every compiled packed kernel (best effort: Triton internals)."""
    from qwen_trt.bench.qkernel_forms import _dq_gemv_kernel
    from qwen_trt.fast.kernels.qkernels_fp8 import _f8w_gemv_kernel, _fp8_gemv_kernel
    from qwen_trt.fast.kernels.qkernels_gemm import _mm_kernel
    from qwen_trt.fast.kernels.qkernels_int4 import _i4_gemv_kernel

    rows = []
    for fn in (_fp8_gemv_kernel, _f8w_gemv_kernel, _i4_gemv_kernel, _dq_gemv_kernel,
               _mm_kernel):
        try:
            for cache in fn.device_caches.values():
                for key, k in cache[0].items():
                    meta = getattr(k, "metadata", None)
                    rows.append({"kernel": fn.fn.__name__, "key": str(key)[-400:],
                                 "regs": getattr(k, "n_regs", None),
                                 "spills": getattr(k, "n_spills", None),
                                 "smem": getattr(meta, "shared", None),
                                 "warps": getattr(meta, "num_warps", None)})
        except Exception as e:  # noqa: BLE001 - internals differ between Triton versions
            rows.append({"kernel": fn.fn.__name__, "error": f"{type(e).__name__}: {e}"[:200]})
    return rows


if __name__ == "__main__":
    sys.exit(main())
