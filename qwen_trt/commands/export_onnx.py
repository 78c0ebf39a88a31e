"""``qwen-trt export-onnx --model DIR --out build/out/onnx``: the first stage of the build pipeline.

Stages, each printed with its time: load the checkpoint, export the decoder to ONNX, validate it
(``onnx.checker`` + shape inference + signature), hash the source and write ``manifest.json``,
then (``--verify``, the default) compare ONNX Runtime with torch: logits for a prefill, decode
steps and a padded batch, and greedy tokens against HF ``generate``.
"""
from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qwen_trt.onnx.export import (DEFAULT_OPSET, DTYPES, EXTERNAL_DATA_MODES, CheckResult,
                                  ExportResult, Manifest)

DEFAULT_OUT = "build/out/onnx"
STAGES = ("load", "export", "check", "manifest", "verify")


@dataclass
class ExportSummary:
    out_dir: Path
    manifest: Manifest
    export: ExportResult
    check: CheckResult
    parity: object | None  # onnx_runtime_check.ParityReport when verified


class Progress:
    """One line per stage: ``[2/5] export   ... done in 4.9s``."""

    def __init__(self, stages: tuple[str, ...], write: Callable[[str], None]) -> None:
        self.stages, self.write = stages, write
        self._t = 0.0

    def start(self, stage: str, what: str) -> None:
        self._t = time.perf_counter()
        n = self.stages.index(stage) + 1
        self.write(f"[{n}/{len(self.stages)}] {stage:<8} {what}")

    def done(self, detail: str = "") -> float:
        dt = time.perf_counter() - self._t
        self.write(f"      {'':<8} {detail + ' ' if detail else ''}({dt:.1f}s)")
        return dt


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def run_pipeline(model: str | None, out: str | Path, *, dtype: str = "float32",
                 opset: int = DEFAULT_OPSET, force: bool = False, verify: bool = True,
                 external_data: str = "auto",
                 write: Callable[[str], None] = print) -> ExportSummary:
    """Export, check, write the manifest and (optionally) verify; raise a QwenTrtError on
    failure."""
    from qwen_trt.onnx import export as ox
    from qwen_trt.model.source import resolve_model

    out_dir = Path(out)
    source = resolve_model(model)
    ox.prepare_output(out_dir, force)
    ox.require("onnx", "onnxscript", *(("onnxruntime",) if verify else ()))
    if dtype not in DTYPES:
        raise ox.OnnxExportError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    ox.check_opset(opset)
    stages = STAGES if verify else STAGES[:-1]
    progress = Progress(stages, write)
    shape = ox.DecoderShape.from_config(source.config)

    progress.start("load", f"{source.name} ({source.config.get('model_type')}, "
                           f"{shape.num_layers} layers) as {dtype}")
    torch_model = ox.load_torch_model(source, dtype)
    progress.done()

    staging = ox.staging_dir(out_dir)
    try:
        exported, checked, manifest, report = _build(
            source, torch_model, staging, shape, progress, write, dtype=dtype, opset=opset,
            external_data=external_data, verify=verify)
    except BaseException as e:
        from qwen_trt.onnx.runtime_check import OnnxParityError

        # A failed parity check keeps its files for inspection (the error says where);
        # anything else (Ctrl-C included) leaves nothing behind.
        if not isinstance(e, OnnxParityError):
            shutil.rmtree(staging, ignore_errors=True)
        raise

    ox.install_output(staging, out_dir)
    final = ExportSummary(out_dir=out_dir, manifest=manifest,
                          export=_moved(exported, out_dir), check=checked, parity=report)
    write(f"wrote {out_dir / ox.MODEL_FILE}"
          + (f" + {ox.DATA_FILE}" if exported.external_data else "")
          + f" and {ox.MANIFEST_FILE}")
    return final


def _build(source, torch_model, staging: Path, shape, progress: Progress,
           write: Callable[[str], None], *, dtype: str, opset: int, external_data: str,
           verify: bool):
    """The export, check, manifest and verify stages, writing into ``staging``."""
    from qwen_trt.onnx import export as ox
    progress.start("export", f"{ox.EXPORTER}, opset {opset}, dynamic batch/seq/past axes")
    exported = ox.export_decoder(torch_model, staging, dtype=dtype, opset=opset,
                                 external_data=external_data)
    where = "external data file " + ox.DATA_FILE if exported.external_data else "inline"
    progress.done(f"{_mb(exported.weight_bytes)} of weights, {where}")

    progress.start("check", "onnx.checker, shape inference, KV signature")
    checked = ox.check_model(exported.model_path, shape, dtype, expected_opset=opset)
    progress.done(f"ok: opset {checked.opset}, {checked.nodes} nodes, "
                  f"{len(checked.inputs)} inputs, {len(checked.outputs)} outputs, "
                  f"initializers {'/'.join(checked.initializer_dtypes)}")

    progress.start("manifest", "sha256 of config.json + *.safetensors")
    sha, files = ox.source_fingerprint(source.path)
    manifest = ox.build_manifest(source, exported, checked, sha, files)
    manifest.write(staging)
    progress.done(f"source sha256 {sha[:16]}...")

    report = None
    if verify:
        from qwen_trt.onnx import runtime_check as rc
        progress.start("verify", "ONNX Runtime (CPU) vs torch: prefill, decode steps, padded "
                                 "batch, greedy tokens")
        tokenizer = _load_tokenizer(source)
        report = rc.verify_export(exported.model_path, torch_model,
                                  rc.default_prompt_ids(tokenizer), dtype=dtype,
                                  pad_id=tokenizer.pad_token_id)
        manifest.verify = report.to_dict()
        manifest.write(staging)
        for line in report.summary():
            write(f"      {'':<8} {line}")
        progress.done("ok" if report.ok else "FAILED")
        if not report.ok:
            raise rc.OnnxParityError(
                f"ONNX Runtime does not match torch (max |logit diff| {report.max_abs_diff:.3g}, "
                f"greedy {'same' if report.greedy_ok else 'different'}); the export is left in "
                f"{staging} for inspection.")

    return exported, checked, manifest, report


def _moved(result: ExportResult, out_dir: Path) -> ExportResult:
    from dataclasses import replace

    return replace(result, out_dir=out_dir, model_path=out_dir / result.model_path.name)


def _load_tokenizer(source):
    from transformers import AutoTokenizer

    from qwen_trt.onnx.export import OnnxExportError

    try:
        return AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError) as e:
        raise OnnxExportError(f"Could not load the tokenizer of '{source.name}': "
                              f"{str(e).splitlines()[0]}") from e


def register(sub) -> None:
    p = sub.add_parser(
        "export-onnx", help="export the checkpoint to ONNX (KV cache in/out) and verify it",
        description="Export the Qwen3 decoder to one ONNX graph with dynamic batch/sequence axes "
                    "and the KV cache as inputs (past_*) and outputs (present_*), check it, and "
                    "compare ONNX Runtime with torch.")
    p.add_argument("--model", default=None,
                   help="Qwen3 checkpoint folder or hub id (default: $QWEN_TRT_MODEL or "
                        "Qwen/Qwen3-4B-Instruct-2507)")
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
