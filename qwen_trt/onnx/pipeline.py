"""The ONNX side branch: export the checkpoint's decoder to ONNX and check it against ONNX
Runtime (``qwen-trt export-onnx``; the command only parses its options).

Stages, each printed with its time (:class:`~qwen_trt.progress.StageLog`): load the checkpoint,
export the decoder to ONNX, validate it (``onnx.checker`` + shape inference + signature), hash
the source and write ``manifest.json``, then (``verify``, the default) compare ONNX Runtime with
torch: logits for a prefill, decode steps and a padded batch, and greedy tokens against HF
``generate``. Files are written into a staging folder and moved into place only when all passed.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from qwen_trt.onnx import export as ox
from qwen_trt.onnx.export import DEFAULT_OPSET, DTYPES, CheckResult, ExportResult, Manifest
from qwen_trt.progress import StageLog

DEFAULT_OUT = "build/out/onnx"
STAGES = ("load", "export", "check", "manifest", "verify")


@dataclass
class ExportSummary:
    out_dir: Path
    manifest: Manifest
    export: ExportResult
    check: CheckResult
    parity: object | None  # runtime_check.ParityReport when verified


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def run_pipeline(model: str | None, out: str | Path, *, dtype: str = "float32",
                 opset: int = DEFAULT_OPSET, force: bool = False, verify: bool = True,
                 external_data: str = "auto",
                 write: Callable[[str], None] = print) -> ExportSummary:
    """Export, check, write the manifest and (optionally) verify; raise a QwenTrtError on
    failure."""
    from qwen_trt.model.source import resolve_model

    out_dir = Path(out)
    source = resolve_model(model)
    ox.prepare_output(out_dir, force)
    ox.require("onnx", "onnxscript", *(("onnxruntime",) if verify else ()))
    if dtype not in DTYPES:
        raise ox.OnnxExportError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    ox.check_opset(opset)
    log = StageLog(len(STAGES) if verify else len(STAGES) - 1, write)
    shape = ox.DecoderShape.from_config(source.config, f"'{source.name}'/config.json")

    torch_model = log.run("load", f"{source.name} ({source.config.get('model_type')}, "
                                  f"{shape.num_layers} layers) as {dtype}",
                          lambda: ox.load_torch_model(source, dtype))

    staging = ox.staging_dir(out_dir)
    try:
        exported, checked, manifest, report = _stages(
            source, torch_model, staging, shape, log, dtype=dtype, opset=opset,
            external_data=external_data, verify=verify)
    except BaseException as e:
        from qwen_trt.onnx.runtime_check import OnnxParityError

        # A failed parity check keeps its files for inspection (the error says where);
        # anything else (Ctrl-C included) leaves nothing behind.
        if not isinstance(e, OnnxParityError):
            shutil.rmtree(staging, ignore_errors=True)
        raise

    ox.install_output(staging, out_dir)
    exported_final = replace(exported, out_dir=out_dir,
                             model_path=out_dir / exported.model_path.name)
    write(f"wrote {out_dir / ox.MODEL_FILE}"
          + (f" + {ox.DATA_FILE}" if exported.external_data else "")
          + f" and {ox.MANIFEST_FILE}")
    return ExportSummary(out_dir=out_dir, manifest=manifest, export=exported_final,
                         check=checked, parity=report)


def _stages(source, torch_model, staging: Path, shape, log: StageLog, *, dtype: str,
            opset: int, external_data: str, verify: bool):
    """The export, check, manifest and verify stages, writing into ``staging``."""
    exported = log.run(
        "export", f"{ox.EXPORTER}, opset {opset}, dynamic batch/seq/past axes",
        lambda: ox.export_decoder(torch_model, staging, dtype=dtype, opset=opset,
                                  external_data=external_data),
        detail=lambda r: f"{_mb(r.weight_bytes)} of weights, "
                         + ("external data file " + ox.DATA_FILE if r.external_data else "inline"))
    checked = log.run(
        "check", "onnx.checker, shape inference, KV signature",
        lambda: ox.check_model(exported.model_path, shape, dtype, expected_opset=opset),
        detail=lambda c: (f"ok: opset {c.opset}, {c.nodes} nodes, {len(c.inputs)} inputs, "
                          f"{len(c.outputs)} outputs, initializers "
                          f"{'/'.join(c.initializer_dtypes)}"))

    def write_manifest() -> tuple[str, Manifest]:
        sha, files = ox.source_fingerprint(source.path)
        manifest = ox.build_manifest(source, exported, checked, sha, files)
        manifest.write(staging)
        return sha, manifest

    sha, manifest = log.run("manifest", "sha256 of config.json + weights", write_manifest,
                            detail=lambda r: f"source sha256 {r[0][:16]}...")
    report = None
    if verify:
        report = log.run("verify", "ONNX Runtime (CPU) vs torch: prefill, decode steps, padded "
                                   "batch, greedy tokens",
                         lambda: _verify(source, torch_model, exported, manifest, staging, log,
                                         dtype),
                         detail=lambda r: "ok" if r.ok else "FAILED")
        if not report.ok:
            from qwen_trt.onnx.runtime_check import OnnxParityError

            raise OnnxParityError(
                f"ONNX Runtime does not match torch (max |logit diff| {report.max_abs_diff:.3g}, "
                f"greedy {'same' if report.greedy_ok else 'different'}); the export is left in "
                f"{staging} for inspection.")
    return exported, checked, manifest, report


def _verify(source, torch_model, exported: ExportResult, manifest: Manifest, staging: Path,
            log: StageLog, dtype: str):
    from qwen_trt.model.source import load_tokenizer
    from qwen_trt.onnx import runtime_check as rc

    tokenizer = load_tokenizer(source.path, source.name)
    report = rc.verify_export(exported.model_path, torch_model, rc.default_prompt_ids(tokenizer),
                              dtype=dtype, pad_id=tokenizer.pad_token_id)
    manifest.verify = report.to_dict()
    manifest.write(staging)
    for line in report.summary():
        log.line(f"      {'':<8} {line}")
    return report
