"""Compile the packed GEMV kernels for sm_90 without a GPU and count SASS instructions in the
main loop (the body of the last backward branch), per weight of one row block:

    PYTHONPATH=.:<triton 3.5 dir> python scripts/qkernel_sass.py [--dump DIR] [--only NAME]

A row block of BLOCK_N rows x K columns is reduced per loop iteration; the count is per lane
(SASS instructions x 32 lanes / weights per iteration / warps... see ``per_weight``)."""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_kernel(fn, consts: dict, types: dict, warps: int, align: bool = True):
    """``align``: pointer arguments 16-byte aligned (``tt.divisibility``), as the JIT
    specializes them for tensors at aligned addresses (every weight and activation here);
    without it no load is wider than one element and none becomes an asynchronous copy."""
    names = fn.arg_names
    # constexpr parameters left to their defaults, as the JIT does (else they would compile
    # as runtime i32 arguments)
    consts = {**{p.name: p.default for p in fn.params
                 if p.is_constexpr and p.has_default and p.name not in consts}, **consts}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in names}
    attrs = ({(i,): [["tt.divisibility", 16]]} for i, n in enumerate(names)
             if sig[n].startswith("*")) if align else ()
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={k: v for a in attrs for k, v in a.items()})
    opts = {"num_warps": warps}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def sass(k) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
        path = f.name
    try:
        return subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path],
                              capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)


def regs(k) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
        path = f.name
    try:
        out = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", path],
                             capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    m = re.search(r"REG:(\d+)", out)
    sp = re.search(r"STACK:(\d+)", out)
    return f"{m.group(1) if m else '?'} stack={sp.group(1) if sp else '?'}"


INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def loop_body(text: str):
    """(instructions of the longest loop: a backward BRA's target .. the branch)."""
    ins = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in INS.finditer(text)]
    best = []
    for i, (addr, op, args) in enumerate(ins):
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", args)
            if t and int(t.group(1), 16) < addr:
                tgt = int(t.group(1), 16)
                body = [x for x in ins if tgt <= x[0] <= addr]
                if len(body) > len(best):
                    best = body
    return best


def summary(body, weights_per_iter: int, warps: int) -> dict:
    ops = collections.Counter(op.split(".")[0] for _, op, _ in body)
    lanes = 32 * warps
    return {"loop_ins": len(body),
            "per_weight": round(len(body) * lanes / weights_per_iter, 3),
            "top": dict(ops.most_common(12))}


def CANDIDATES(Q):
    out = []
    for shape in ("qkv", "gate_up", "down"):
        for fmt, fname in ((Q.FMT_FP8, "fp8"), (Q.FMT_INT4, "int4")):
            for asm in (False, True):
                cfg = Q.gemv_config(fmt, *{"qkv": (6144, 2560, False),
                                           "gate_up": (9728, 2560, True),
                                           "down": (2560, 9728, False)}[shape])
                cfg = Q.QConfig(**{**cfg.__dict__, "asm": asm})
                out.append((f"{fname}{'-asm' if asm else ''}-{shape}", fmt, shape, cfg))
        for bn, warps in ((1, 4), (2, 4), (2, 8), (4, 8)):
            out.append((f"fp8-fold-{bn}x{warps}-{shape}", Q.FMT_FP8, shape,
                        Q.QConfig(block_n=bn, warps=warps, fold=True)))
            out.append((f"int4-fold-{bn}x{warps}-{shape}", Q.FMT_INT4, shape,
                        Q.QConfig(block_n=bn, warps=warps, fold=True, asm=True)))
        # the f16x2 forms (QConfig.half)
        for bn, warps in ((4, 8), (8, 8), (8, 4)):
            for fmt, fname in ((Q.FMT_FP8, "fp8"), (Q.FMT_INT4, "int4")):
                out.append((f"{fname}-half-{bn}x{warps}-{shape}", fmt, shape,
                            Q.QConfig(block_n=bn, warps=warps, half=True)))
        # the sweep's --probe diagnostic (one multiply a word, the same loads)
        out.append((f"fp8-fold-probe-{shape}", Q.FMT_FP8, shape,
                    Q.QConfig(block_n=4, warps=8, fold=True, probe=True)))
        out.append((f"int4-probe-{shape}", Q.FMT_INT4, shape,
                    Q.QConfig(block_n=4, warps=8, ahead=2, probe=True)))
    # the tensor-core GEMV (QConfig.dot): the sweep's candidates
    from qwen_trt.bench.qkernel_sweep import DOT_CANDIDATES

    for (fname, shape), cands in DOT_CANDIDATES.items():
        if shape == "o":
            continue
        fmt = Q.FMT_FP8 if fname == "fp8" else Q.FMT_INT4
        for bn, warps, bk, st, sp, pre in cands:
            out.append((f"{fname}-dot-{bn}x{warps}-bk{bk}-s{st}-k{sp}-l2{pre}-{shape}", fmt,
                        shape, Q.QConfig(block_n=bn, warps=warps, bk=bk, stages=st,
                                         split=sp, dot=True, l2pre=pre)))
    return out


def features(k, text: str) -> dict:
    """Shared memory, and which tensor-core and asynchronous-copy instructions the kernel
    has (SASS: HMMA = mma.sync, HGMMA = wgmma, LDGSTS = cp.async, UTMALDG = TMA; CCTL = the
    L2 prefetches)."""
    ops = collections.Counter(m.group(3).split(".")[0] for m in INS.finditer(text))
    return {"smem": getattr(k.metadata, "shared", None),
            **{op: ops[op] for op in ("HMMA", "HGMMA", "LDGSTS", "UTMALDG", "CCTL", "LDG")
               if ops[op]}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dump", default=None)
    p.add_argument("--only", default=None)
    args = p.parse_args()
    from qwen_trt.bench import qkernel_forms
    from qwen_trt.fast.kernels import qkernels as Q

    shapes = {"qkv": (6144, 2560, False, False, True), "o": (2560, 4096, False, True, False),
              "gate_up": (9728, 2560, True, False, True), "down": (2560, 9728, False, True, False)}
    types = {"q_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*i32", "x_ptr": "*bf16",
             "out_ptr": "*bf16", "ln_ptr": "*bf16", "res_ptr": "*bf16", "part_ptr": "*fp32",
             "eps": "fp32"}
    for name, fmt, shape, cfg in CANDIDATES(Q):
        if args.only and args.only not in name:
            continue
        n, k, gate_up, res, ln = shapes[shape]
        ks = -(-k // 128)
        sk = 128
        plan = qkernel_forms.gemv_plan if cfg.dot else Q._gemv_plan
        kern, consts = plan(fmt, n, k, ks, sk, 128, cfg, norm=ln, residual=res,
                            gate_up=gate_up, pdl=True, grid=264, cuda=True)
        # weights per main-loop iteration: a row block (a pipeline step for ``dot``)
        wpi = ((max(16, cfg.block_n) * max(cfg.bk, sk)) if cfg.dot
               else cfg.block_n * k) * (2 if gate_up else 1)
        t = dict(types)
        if fmt == Q.FMT_INT4:
            t["q_ptr"] = "*i32"
            t["s_ptr"] = "*fp16"
        try:
            kc = compile_kernel(kern, consts, t, cfg.warps)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: compile failed: {type(e).__name__}: {str(e)[:400]}")
            continue
        text = sass(kc)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, name + ".sass"), "w") as f:
                f.write(text)
        s = summary(loop_body(text), wpi, cfg.warps)
        print(f"{name}: regs={regs(kc)} {features(kc, text)} {s}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
