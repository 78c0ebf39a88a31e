"""``qwen-trt export-onnx --model DIR --out build/out/onnx``: export the checkpoint to ONNX and
check it against ONNX Runtime (the pipeline: :mod:`qwen_trt.onnx.pipeline`)."""
from __future__ import annotations

import argparse
import time

from qwen_trt import settings
from qwen_trt.onnx.export import DEFAULT_OPSET, DTYPES, EXTERNAL_DATA_MODES
from qwen_trt.onnx.pipeline import DEFAULT_OUT, run_pipeline

def register(sub) -> None:
    p = sub.add_parser(
        "export-onnx", help="export the checkpoint to ONNX (KV cache in/out) and verify it",
        description="Export the Qwen3 decoder to one ONNX graph with dynamic batch/sequence axes "
                    "and the KV cache as inputs (past_*) and outputs (present_*), check it, and "
                    "compare ONNX Runtime with torch.")
    p.add_argument("--model", default=None,
                   help="Qwen3 checkpoint folder or hub id (default: $QWEN_TRT_MODEL or "
                        f"{settings.declared('QWEN_TRT_MODEL').default})")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV dtype")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET,
                   help="ONNX opset, 18 or newer (default %(default)s)")
    p.add_argument("--external-data", choices=EXTERNAL_DATA_MODES, default="auto",
                   help="auto: weights go to model.onnx.data when over 2 GB; always: always")
    p.add_argument("--force", action="store_true", help="overwrite an existing output folder")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="compare ONNX Runtime with torch after export (default on; --no-verify "
                        "to skip)")
    p.set_defaults(func=run)


def run(args) -> int:
    t0 = time.perf_counter()
    summary = run_pipeline(args.model, args.out, dtype=args.dtype, opset=args.opset,
                           force=args.force, verify=args.verify,
                           external_data=args.external_data,
                           write=lambda line: print(line, flush=True))
    print(f"export-onnx finished in {time.perf_counter() - t0:.1f}s"
          + ("" if summary.parity is None else " (ONNX Runtime matches torch)"))
    return 0
