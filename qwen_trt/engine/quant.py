"""Quantized engines (``make engine GPU=<gpu> QUANT=<name>``): which quantizations the engine
path builds, what each needs from the GPU, and how TensorRT-LLM is asked for it.

Upstream, as read in NVIDIA/TensorRT-LLM (stored snapshots; the commit each was read at):

* ``QuantConfig(quant_algo, kv_cache_quant_algo, group_size=128, ...)`` from
  ``tensorrt_llm.models.modeling_utils`` and ``QuantAlgo`` from ``tensorrt_llm.quantization``.
* Weight-only INT8 / INT4 (``W8A16`` / ``W4A16``) need no calibration: the converter quantizes
  while it loads (``from_hugging_face(..., quant_config=...)``, the "native" flow).
* FP8 and INT4-AWQ (``FP8`` / ``W4A16_AWQ``) go through NVIDIA ModelOpt with a calibration set:
  ``PretrainedModel.quantize(hf_model_dir, output_dir, dtype, mapping, quant_config, *,
  device='cuda', calib_dataset='cnn_dailymail', calib_batches=512, calib_batch_size=1,
  calib_max_seq_length=512, random_seed=1234, tokenizer_max_seq_length=2048)``
  (tensorrt_llm/models/modeling_utils.py, stored snapshot; ``DEFAULT_MODELOPT_FLOW`` = W4A16_AWQ,
  FP8, W8A8_SQ_PER_CHANNEL; ``NATIVE_QUANT_FLOW`` = W4A16, W8A16, None), which writes the
  TensorRT-LLM checkpoint itself.
* FP8 with 128x128 block scales (Qwen's own ``Qwen3-4B-Instruct-2507-FP8`` checkpoint,
  ``QuantAlgo.FP8_BLOCK_SCALES``) is **not** an engine-path option: the engine path's
  ``quantize(model, quant_config)`` dispatches on the quant mode to per-tensor FP8 QDQ, FP8
  rowwise, NVFP4, SmoothQuant, QServe and weight-only layers and has no block-scales branch
  (tensorrt_llm/quantization/quantize.py @89fd9b74); block-scaled FP8 runs on the PyTorch
  backend, i.e. the LLM API path (``--backend trtllm --model Qwen/Qwen3-4B-Instruct-2507-FP8``).
  So ``QUANT=fp8`` here is ModelOpt's per-tensor FP8 calibrated on a named set.
* FP8 needs FP8 tensor cores: Ada (sm89: L4, RTX 4090) or Hopper (sm90: H100, H200)
  (docs/source/reference/support-matrix.md).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from qwen_trt.errors import QwenTrtError


class QuantError(QwenTrtError):
    """A quantization this GPU (or this engine path) cannot build or run."""


@dataclass(frozen=True)
class Calibration:
    """The ModelOpt calibration set (upstream's defaults, named so the manifest records them)."""

    dataset: str = "cnn_dailymail"
    batches: int = 512
    max_seq_length: int = 512


@dataclass(frozen=True)
class QuantSpec:
    name: str                     # the QUANT= value and the engine folder suffix
    quant_algo: str               # tensorrt_llm.quantization.QuantAlgo member name
    min_cc: tuple[int, int]       # the oldest compute capability that runs it
    modelopt: bool                # calibrated through ModelOpt (else quantized while converting)
    weight_bits: int              # bits per weight of the quantized linear layers
    description: str
    group_size: int = 128

    def calibration(self) -> Calibration | None:
        return Calibration() if self.modelopt else None

    def to_manifest(self) -> dict:
        cal = self.calibration()
        return {"name": self.name, "quant_algo": self.quant_algo, "kv_cache_quant_algo": None,
                "group_size": self.group_size if self.quant_algo.endswith(("AWQ", "W4A16")) else None,
                "weight_bits": self.weight_bits, "min_compute_capability": _cc(self.min_cc),
                "calibration": asdict(cal) if cal else None}


QUANTS: dict[str, QuantSpec] = {q.name: q for q in (
    QuantSpec("fp8", "FP8", (8, 9), True, 8,
              "FP8 weights and activations, per-tensor scales (ModelOpt); L4, RTX 4090, H100, H200"),
    QuantSpec("int4_awq", "W4A16_AWQ", (8, 0), True, 4,
              "INT4 weights, AWQ-calibrated (ModelOpt), FP16 activations; for 24 GB cards"),
    QuantSpec("int8_wo", "W8A16", (8, 0), False, 8,
              "INT8 weight-only, no calibration"),
    QuantSpec("int4_wo", "W4A16", (8, 0), False, 4,
              "INT4 weight-only, no calibration"),
)}
FP8_GPUS = "L4, RTX 4090, H100, H200"


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def _sm(cc: tuple[int, int]) -> str:
    return f"sm{cc[0]}{cc[1]}"


def get_quant(name: str | None) -> QuantSpec | None:
    """The spec of ``QUANT=name`` (None or "" or "none": an unquantized engine)."""
    if name in (None, "", "none"):
        return None
    spec = QUANTS.get(str(name).lower())
    if spec is None:
        raise QuantError(f"QUANT={name}: expected one of {', '.join(QUANTS)} (or leave it out for "
                         f"the FP16 engine).")
    return spec


def others_for(cc: tuple[int, int]) -> list[str]:
    return [q.name for q in QUANTS.values() if tuple(cc) >= q.min_cc]


def check_gpu(spec: QuantSpec | None, gpu, subject: str) -> None:
    """One line when ``gpu`` cannot run ``spec``; ``subject`` starts it ("QUANT=fp8")."""
    if spec is None or tuple(gpu.compute_capability) >= spec.min_cc:
        return
    fits = [n for n in others_for(gpu.compute_capability) if n != spec.name]
    hint = (f"build QUANT={' or QUANT='.join(fits[:2])}" if fits else "build the FP16 engine")
    needs = f"an {_sm(spec.min_cc)}+ GPU" + (f" ({FP8_GPUS})" if spec.name == "fp8" else "")
    raise QuantError(f"{subject} ({spec.quant_algo}) needs {needs}; this GPU is "
                     f"{gpu.short_name} ({gpu.sm}): {hint}, or the FP16 engine.")


def manifest_quant(manifest: dict) -> QuantSpec | None:
    """The quantization a manifest records (None: unquantized, also for older manifests)."""
    q = manifest.get("quantization")
    if not isinstance(q, dict) or not q.get("name"):
        return None
    return QUANTS.get(q["name"])


def engine_weight_bytes(params: int, embed_params: int, tied: bool, spec: QuantSpec | None,
                        width: int = 2) -> int:
    """Weight bytes of an engine: the linear layers at the quantized width, the embedding (and,
    when tied, its lm_head copy: see build.engine_weights) at 16 bits, never quantized here."""
    copies = embed_params if tied else 0
    if spec is None:
        return (params + copies) * width
    linear = max(0, params - embed_params)
    return int(linear * spec.weight_bits / 8) + (embed_params + copies) * width


def quant_config(spec: QuantSpec):
    """A real ``tensorrt_llm`` QuantConfig for ``spec`` (needs tensorrt_llm)."""
    from tensorrt_llm.models.modeling_utils import QuantConfig
    from tensorrt_llm.quantization import QuantAlgo

    return QuantConfig(quant_algo=getattr(QuantAlgo, spec.quant_algo), kv_cache_quant_algo=None,
                       group_size=spec.group_size)
