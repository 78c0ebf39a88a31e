"""Export a Qwen3 checkpoint to one ONNX decoder graph with the KV cache as inputs and outputs.

The graph takes ``input_ids [batch, seq]``, ``attention_mask [batch, past+seq]``,
``position_ids [batch, seq]`` and ``past_key_<i>`` / ``past_value_<i>`` ``[batch, kv_heads, past,
head_dim]`` for every layer, and returns ``logits [batch, seq, vocab]`` and ``present_key_<i>`` /
``present_value_<i>`` ``[batch, kv_heads, past+seq, head_dim]``. Prefill passes empty past tensors
(``past = 0``); each decode step feeds the previous step's ``present_*`` back as ``past_*``, so one
graph serves both.

We export through ``torch.onnx.export(..., dynamo=True)`` (``torch.export`` + onnxscript): it
records symbolic shapes, so the shape-dependent branches in transformers' mask code are either
kept general or rejected at export time, where the TorchScript tracer (``dynamo=False``) freezes
them silently for the example shapes (it prints TracerWarnings on exactly those lines).
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qwen_trt.engine.env import module_version
from qwen_trt.errors import first_line, QwenTrtError
from qwen_trt.model.source import ModelSource

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
MANIFEST_FILE = "manifest.json"
OUTPUT_FILES = (MODEL_FILE, DATA_FILE, MANIFEST_FILE)
MANIFEST_FORMAT = "qwen-trt-onnx/1"
DEFAULT_OPSET = 18
MIN_OPSET = 18
DTYPES = ("float32", "float16")
EXTERNAL_DATA_MODES = ("auto", "always")
# Protobuf cannot hold a message of 2 GiB or more; auto mode moves weights out well before that.
PROTOBUF_LIMIT_BYTES = 2**31
EXPORTER = "torch.onnx.export(dynamo=True)"
INSTALL_HINT = 'pip install -e ".[onnx]"'


class OnnxExportError(QwenTrtError):
    """The ONNX export or its validation failed."""


class OnnxDependencyError(QwenTrtError):
    """onnx / onnxscript / onnxruntime is not installed."""


class OutputExistsError(QwenTrtError):
    """The output folder already holds files and --force was not given."""


def require(*modules: str) -> None:
    """Import ``modules`` or raise one line that says how to install them."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise OnnxDependencyError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
            f"{INSTALL_HINT}")


# --------------------------------------------------------------------------- graph signature


def input_names(num_layers: int) -> list[str]:
    names = ["input_ids", "attention_mask", "position_ids"]
    for i in range(num_layers):
        names += [f"past_key_{i}", f"past_value_{i}"]
    return names


def output_names(num_layers: int) -> list[str]:
    names = ["logits"]
    for i in range(num_layers):
        names += [f"present_key_{i}", f"present_value_{i}"]
    return names


@dataclass(frozen=True)
class DecoderShape:
    """What the graph signature depends on, read from config.json."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "DecoderShape":
        """The signature's part of :class:`ModelShape` (one head_dim policy everywhere)."""
        from qwen_trt.model.shape import ModelShape

        s = ModelShape.from_config(config, where)
        return cls(num_layers=s.layers, num_kv_heads=s.kv_heads, head_dim=s.head_dim,
                   vocab_size=s.vocab)


def make_decoder_module(model):
    """Wrap a HF ``Qwen3ForCausalLM`` so its forward takes and returns the KV cache as tensors."""
    import inspect

    import torch
    from transformers import DynamicCache

    num_layers = model.config.num_hidden_layers
    # transformers 5.2x calls the cache argument ``cache``; 4.57 calls it ``past_key_values``.
    cache_kw = ("cache" if "cache" in inspect.signature(model.forward).parameters
                else "past_key_values")

    class KvCacheDecoder(torch.nn.Module):
        """(input_ids, attention_mask, position_ids, past_key_0, past_value_0, ...) ->
        (logits, present_key_0, present_value_0, ...)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            pairs = [(past[2 * i], past[2 * i + 1]) for i in range(num_layers)]
            cache = DynamicCache(pairs, config=self.model.config)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, use_cache=True, **{cache_kw: cache})
            present = getattr(out, cache_kw, None)
            if present is None:
                present = out.past_key_values
            flat = [out.logits]
            for i in range(num_layers):
                flat += list(_layer_kv(present, i))
            return tuple(flat)

    return KvCacheDecoder().eval()


def _layer_kv(cache, i: int):
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]  # older transformers


def example_inputs(shape: DecoderShape, dtype, batch: int = 2, seq: int = 5, past: int = 3):
    """Example tensors for tracing; sizes differ from each other and from 0/1 so no axis is
    specialised to a constant."""
    import torch

    ids = torch.randint(0, shape.vocab_size, (batch, seq), dtype=torch.long)
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    pos = torch.arange(past, past + seq, dtype=torch.long).unsqueeze(0).expand(batch, seq)
    kv = [torch.zeros(batch, shape.num_kv_heads, past, shape.head_dim, dtype=dtype)
          for _ in range(2 * shape.num_layers)]
    return (ids, mask, pos, *kv)


def dynamic_shapes(num_layers: int) -> dict:
    from torch.export import Dim

    batch, seq, past, total = Dim("batch"), Dim("seq"), Dim("past"), Dim("total")
    return {
        "input_ids": {0: batch, 1: seq},
        "attention_mask": {0: batch, 1: total},
        "position_ids": {0: batch, 1: seq},
        "past": tuple({0: batch, 2: past} for _ in range(2 * num_layers)),
    }


# --------------------------------------------------------------------------- provenance


def source_fingerprint(path: Path) -> tuple[str, list[dict]]:
    """The checkpoint's sha256 as the engine manifest records it (config and weights, see
    ``engine.manifest.checkpoint_files``), and the files it covers."""
    from qwen_trt.engine.manifest import checkpoint_files, content_hash

    files = checkpoint_files(path)
    return content_hash(files, path), [{"name": f.name, "bytes": f.stat().st_size} for f in files]


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: list  # ints for fixed axes, strings for symbolic ones


@dataclass
class ExportResult:
    out_dir: Path
    model_path: Path
    dtype: str
    opset: int
    external_data: bool
    weight_bytes: int
    seconds: float


@dataclass
class CheckResult:
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    initializer_dtypes: list[str]
    nodes: int
    opset: int
    seconds: float


@dataclass
class Manifest:
    """``manifest.json`` next to the model: what was exported from what, and how."""

    format: str
    model_file: str
    data_files: list[str]
    opset: int
    dtype: str
    exporter: str
    source: dict
    model_config: dict
    inputs: list[dict]
    outputs: list[dict]
    versions: dict
    created_utc: str
    verify: dict | None = None
    notes: list[str] = field(default_factory=list)

    def write(self, out_dir: Path) -> Path:
        path = out_dir / MANIFEST_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path


def read_manifest(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / MANIFEST_FILE).read_text())


# --------------------------------------------------------------------------- stages


def prepare_output(out_dir: Path, force: bool) -> None:
    """Refuse a non-empty output folder unless ``force``; never delete anything but our files."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputExistsError(f"--out {out_dir} is a file, not a folder.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise OutputExistsError(
            f"Output folder {out_dir} already exists and is not empty: pass --force to overwrite "
            f"it, or choose another --out.")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the exporter's own progress lines, log warnings (e.g. "torchvision is not
    installed") and Python warnings; errors still propagate."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def load_torch_model(source: ModelSource, dtype: str):
    """The HF model in ``dtype`` on CPU with eager attention (explicit MatMul/Softmax ops, the
    softmax in float32 also for float16 weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise OnnxExportError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.")
    try:
        with quiet():
            model = AutoModelForCausalLM.from_pretrained(
                source.path, dtype=getattr(torch, dtype), attn_implementation="eager")
    except (OSError, ValueError) as e:
        raise OnnxExportError(first_line(f"Could not load '{source.name}': {e}")) from e
    return model.to("cpu").eval()


def check_opset(opset: int) -> None:
    """The dynamo exporter writes opset 18 natively and converts upward only."""
    import onnx

    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise OnnxExportError(f"--opset {opset} is not supported: the torch.onnx dynamo exporter "
                              f"writes opset {MIN_OPSET} to {newest} (onnx {onnx.__version__}).")


def export_decoder(model, out_dir: Path, *, dtype: str, opset: int = DEFAULT_OPSET,
                   external_data: str = "auto") -> ExportResult:
    """Export ``model`` to ``out_dir/model.onnx`` (+ ``model.onnx.data`` when external)."""
    require("onnx", "onnxscript")
    import torch

    if external_data not in EXTERNAL_DATA_MODES:
        raise OnnxExportError(f"external_data must be one of {EXTERNAL_DATA_MODES}")
    check_opset(opset)
    shape = DecoderShape.from_config(model.config.to_dict())
    decoder = make_decoder_module(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    external = external_data == "always" or weight_bytes >= PROTOBUF_LIMIT_BYTES - (256 << 20)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = out_dir / MODEL_FILE
    t0 = time.perf_counter()
    try:
        with quiet(), torch.no_grad():
            program = torch.onnx.export(
                decoder, example_inputs(shape, getattr(torch, dtype)), None, dynamo=True,
                input_names=input_names(shape.num_layers),
                output_names=output_names(shape.num_layers),
                dynamic_shapes=dynamic_shapes(shape.num_layers), opset_version=opset,
                optimize=True, verbose=False)
            # save() moves the weights to the external file itself above 2 GB.
            program.save(str(model_path), external_data=True if external else None)
    except QwenTrtError:
        raise
    except Exception as e:  # the exporter raises many types; the user needs the one line
        first = first_line(e)
        raise OnnxExportError(f"torch.onnx.export failed ({type(e).__name__}): {first}") from e
    external = (out_dir / DATA_FILE).exists()
    return ExportResult(out_dir=out_dir, model_path=model_path, dtype=dtype, opset=opset,
                        external_data=external, weight_bytes=weight_bytes,
                        seconds=time.perf_counter() - t0)


_ONNX_DTYPE_NAMES = {1: "float32", 6: "int32", 7: "int64", 9: "bool", 10: "float16", 16: "bfloat16"}


def _specs(values) -> list[TensorSpec]:
    specs = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        specs.append(TensorSpec(name=v.name, dtype=_ONNX_DTYPE_NAMES.get(t.elem_type,
                                                                         str(t.elem_type)),
                                shape=dims))
    return specs


def check_model(model_path: Path, expected: DecoderShape, dtype: str,
                expected_opset: int | None = None) -> CheckResult:
    """``onnx.checker`` + strict shape inference (by path, so > 2 GB models work), then make sure
    the signature is the one the runtime expects."""
    require("onnx")
    import onnx

    t0 = time.perf_counter()
    try:
        onnx.checker.check_model(str(model_path), full_check=False)
        inferred_path = model_path.with_name(model_path.name + ".inferred.tmp")
        try:
            onnx.shape_inference.infer_shapes_path(str(model_path), str(inferred_path),
                                                   strict_mode=True)
        finally:
            inferred_path.unlink(missing_ok=True)
        proto = onnx.load(str(model_path), load_external_data=False)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise OnnxExportError(f"{model_path} failed the ONNX checker: "
                              f"{first_line(e)}") from e
    inputs, outputs = _specs(proto.graph.input), _specs(proto.graph.output)
    want_in, want_out = input_names(expected.num_layers), output_names(expected.num_layers)
    if [s.name for s in inputs] != want_in or [s.name for s in outputs] != want_out:
        raise OnnxExportError(
            f"{model_path} has inputs {[s.name for s in inputs]} / outputs "
            f"{[s.name for s in outputs]}, expected {want_in} / {want_out}.")
    kv_specs = [s for s in inputs + outputs if s.name.startswith(("past_", "present_"))]
    bad = [s.name for s in kv_specs
           if s.dtype != dtype or s.shape[1] != expected.num_kv_heads
           or s.shape[3] != expected.head_dim or not isinstance(s.shape[2], str)]
    if bad:
        raise OnnxExportError(f"{model_path}: KV tensors {bad} do not have dtype {dtype}, "
                              f"shape [batch, {expected.num_kv_heads}, <dynamic>, "
                              f"{expected.head_dim}].")
    init_dtypes = sorted({_ONNX_DTYPE_NAMES.get(t.data_type, str(t.data_type))
                          for t in proto.graph.initializer})
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    if expected_opset is not None and opset != expected_opset:
        raise OnnxExportError(f"{model_path} is opset {opset}, but opset {expected_opset} was "
                              f"asked for: the exporter could not convert it.")
    return CheckResult(inputs=inputs, outputs=outputs, initializer_dtypes=init_dtypes,
                       nodes=len(proto.graph.node), opset=opset,
                       seconds=time.perf_counter() - t0)


def build_manifest(source: ModelSource, export: ExportResult, check: CheckResult,
                   source_sha256: str, source_files: list[dict]) -> Manifest:
    shape = DecoderShape.from_config(source.config)
    return Manifest(
        format=MANIFEST_FORMAT,
        model_file=MODEL_FILE,
        data_files=[DATA_FILE] if export.external_data else [],
        opset=check.opset,
        dtype=export.dtype,
        exporter=EXPORTER,
        source={"name": source.name, "path": str(source.path), "sha256": source_sha256,
                "hashed_files": source_files},
        model_config={"model_type": source.config.get("model_type"),
                      **asdict(shape), "weight_bytes": export.weight_bytes},
        inputs=[asdict(s) for s in check.inputs],
        outputs=[asdict(s) for s in check.outputs],
        versions={m: module_version(m) for m in ("torch", "transformers", "onnx", "onnxscript",
                                           "onnxruntime")},
        created_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        notes=["prefill: pass past_* with 0 on the past axis; decode: feed present_* back",
               "attention_mask covers past+seq positions (1 = attend, 0 = padding)"],
    )


def install_output(staging: Path, out_dir: Path) -> None:
    """Move the finished files from ``staging`` into ``out_dir``, replacing only our own files."""
    if not out_dir.exists():
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out_dir)
        return
    for name in OUTPUT_FILES:
        (out_dir / name).unlink(missing_ok=True)
    for f in staging.iterdir():
        shutil.move(str(f), str(out_dir / f.name))
    staging.rmdir()


def staging_dir(out_dir: Path) -> Path:
    """A fresh sibling folder, so a failed export never leaves a half-written --out behind."""
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    path = parent / f".{out_dir.name}.partial"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir()
    return path
