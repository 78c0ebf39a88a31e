"""``qwen-trt quantize (--fp8 | --int4-rtn) SRC DST``: write a quantized copy of a checkpoint
for the fast path (and for other engines that read these formats): Qwen's block FP8, or INT4 by
round to nearest in the AWQ (GEMM) or GPTQ layout."""
from __future__ import annotations

import time

from qwen_trt.errors import ModelSourceError


def register(sub) -> None:
    p = sub.add_parser("quantize", help="write an FP8 or INT4 copy of a bf16 checkpoint")
    p.add_argument("src", help="bf16 checkpoint folder (config.json + *.safetensors)")
    p.add_argument("dst", help="output folder")
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--fp8", action="store_true",
                   help="float8_e4m3fn weights, one scale per 128x128 block (Qwen's FP8 format)")
    m.add_argument("--int4-rtn", action="store_true",
                   help="4-bit weights, group scales + zero points by round to nearest (no "
                        "calibration: lower quality than AWQ/GPTQ; for tests and speed)")
    p.add_argument("--layout", choices=("awq", "gptq"), default="awq",
                   help="--int4-rtn: the checkpoint layout (default awq, GEMM packing)")
    p.add_argument("--group-size", type=int, default=128,
                   help="--int4-rtn: columns per scale (default 128; smaller when a projection "
                        "is narrower)")
    p.add_argument("--device", default="cpu", help="where the numbers are computed (cpu, cuda)")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from qwen_trt.fast.model.qcheckpoint import quantize_checkpoint

    dst = Path(args.dst)
    if dst.exists() and any(dst.iterdir()):
        raise ModelSourceError(f"'{dst}' is not empty: quantize writes a new folder")
    t = time.perf_counter()
    quantize_checkpoint(args.src, dst, "fp8" if args.fp8 else "int4", layout=args.layout,
                        group=args.group_size, device=args.device)
    print(f"done in {time.perf_counter() - t:.1f}s")
    return 0
