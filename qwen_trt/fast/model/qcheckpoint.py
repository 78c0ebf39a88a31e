"""Quantized checkpoints: reading their ``quantization_config`` and projections, and writing them
(``qwen-trt quantize``).

Formats read (each projection ``model.layers.L.self_attn.{q,k,v,o}_proj`` and
``model.layers.L.mlp.{gate,up,down}_proj``; a projection the checkpoint kept in bf16 -- its ``.weight`` is not packed -- loads dense):

* ``quant_method: fp8`` -- Qwen's fine-grained FP8 (``Qwen/Qwen3-4B-Instruct-2507-FP8``):
  ``fmt: e4m3``, ``weight_block_size: [128, 128]``, ``activation_scheme: dynamic``; per projection
  ``.weight`` (``float8_e4m3fn [N, K]``) and ``.weight_scale_inv`` (``[ceil(N/128), ceil(K/128)]``,
  float32, bfloat16 or float16 as the checkpoint has it; ``w = weight * weight_scale_inv``).
  Embedding, LM head and norms stay bf16.
* ``quant_method: awq`` (``version: gemm``, ``bits: 4``, ``zero_point: true``): ``.qweight``,
  ``.qzeros``, ``.scales`` (see :func:`qwen_trt.fast.model.qformats.from_awq`).
* ``quant_method: gptq`` (``bits: 4``, ``desc_act: false``; ``checkpoint_format`` ``gptq`` or
  ``gptq_v2``): ``.qweight``, ``.qzeros``, ``.scales``, ``.g_idx``.

Every format error is one line naming the file and what is wrong (:class:`ModelSourceError`).
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qwen_trt.errors import ModelSourceError
from qwen_trt.fast.model.qformats import (FP8_BLOCK, FP8_DTYPE, INT4_GROUP, Fp8Linear, QuantSpec,
                                    Weight, fp8_quantize, from_awq, from_gptq, group_for,
                                    quantize, to_awq, to_gptq)

# HF name of each part of the fused projections
PARTS = {"wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "wo": ("self_attn.o_proj",),
         "w_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
         "w_down": ("mlp.down_proj",)}
LAYOUTS = ("fp8", "awq", "gptq")


@dataclass(frozen=True)
class CheckpointQuant:
    """What a checkpoint's ``quantization_config`` says: ``layout`` "" (none), fp8, awq or
    gptq; ``zero_offset``: added to GPTQ's stored zeros."""

    layout: str = ""
    block: tuple[int, int] = FP8_BLOCK
    group: int = INT4_GROUP
    zero_offset: int = 1

    @property
    def method(self) -> str:
        return {"": "none", "fp8": "fp8"}.get(self.layout, "int4")

    def spec(self) -> QuantSpec:
        return QuantSpec(self.method, self.block, self.group)


def read_quant_config(hf: dict, where: str) -> CheckpointQuant:
    """The checked ``quantization_config`` of a parsed ``config.json`` (``where``: its path,
    for messages)."""
    qc = hf.get("quantization_config")
    if not qc:
        return CheckpointQuant()
    if not isinstance(qc, dict):
        raise ModelSourceError(f"{where}: quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ModelSourceError(f"{where}: fp8 fmt '{fmt}' is not supported (e4m3 only)")
        block = qc.get("weight_block_size")
        if block is None:
            raise ModelSourceError(f"{where}: fp8 without weight_block_size (per-tensor scales) "
                                   "is not supported: the fast path reads 128x128 block scales")
        if (not isinstance(block, list) or len(block) != 2
                or tuple(block) != FP8_BLOCK):
            raise ModelSourceError(f"{where}: fp8 weight_block_size {block} is not supported: "
                                   f"the fast path reads {list(FP8_BLOCK)} blocks")
        return CheckpointQuant("fp8", FP8_BLOCK)
    if method in ("awq", "gptq"):
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ModelSourceError(f"{where}: {method} with bits={bits} is not supported (4 only)")
        group = qc.get("group_size", qc.get("q_group_size"))
        if not isinstance(group, int) or group < 16 or group & (group - 1):
            raise ModelSourceError(f"{where}: {method} group_size {group!r} is not supported "
                                   "(a power of two >= 16; -1, one group per row, is not)")
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ModelSourceError(f"{where}: awq version '{version}' is not supported "
                                       "(GEMM packing only)")
            if qc.get("zero_point", True) is not True:
                raise ModelSourceError(f"{where}: awq without zero_point is not supported")
            return CheckpointQuant("awq", group=group)
        if qc.get("desc_act"):
            raise ModelSourceError(f"{where}: gptq with desc_act (act-order) is not supported: "
                                   "use a checkpoint quantized without act-order")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelSourceError(f"{where}: gptq checkpoint_format '{fmt}' is not supported")
        return CheckpointQuant("gptq", group=group, zero_offset=1 if fmt == "gptq" else 0)
    raise ModelSourceError(f"{where}: quant_method '{method}' is not supported by the fast path "
                           "(fp8, awq, gptq)")


Getter = Callable[[str], torch.Tensor]


class ProjectionReader:
    """Reads one HF projection (``prefix`` = ``model.layers.L.self_attn.q_proj``) in the
    checkpoint's format: a dense tensor or a :class:`~qwen_trt.fast.model.qformats.PackedLinear`.
    ``get(name)`` loads a tensor, ``has(name)`` tells whether it exists, ``locate(name)`` names
    the file it is (or should be) in."""

    def __init__(self, quant: CheckpointQuant, get: Getter, has: Callable[[str], bool],
                 locate: Callable[[str], str]) -> None:
        self.quant, self.get, self.has, self.locate = quant, get, has, locate

    def _need(self, name: str, why: str) -> torch.Tensor:
        if not self.has(name):
            raise ModelSourceError(f"{self.locate(name)} lacks {name} ({why})")
        return self.get(name)

    def _bad(self, name: str, what: str) -> ModelSourceError:
        return ModelSourceError(f"{self.locate(name)}: {name} {what}")

    def read(self, prefix: str) -> Weight:
        lay = self.quant.layout
        if lay == "fp8":
            return self._fp8(prefix)
        if lay in ("awq", "gptq") and self.has(prefix + ".qweight"):
            return self._int4(prefix, lay)
        w = self._need(prefix + ".weight", "the checkpoint is incomplete")
        if w.dtype == FP8_DTYPE:
            raise self._bad(prefix + ".weight", "is float8_e4m3fn but config.json has no fp8 "
                            "quantization_config")
        return w

    def _fp8(self, prefix: str) -> Weight:
        wname, sname = prefix + ".weight", prefix + ".weight_scale_inv"
        w = self._need(wname, "the checkpoint is incomplete")
        if w.dtype != FP8_DTYPE:
            if self.has(sname):
                raise self._bad(wname, f"is {str(w.dtype).replace('torch.', '')} beside a "
                                "weight_scale_inv: expected float8_e4m3fn")
            return w                      # a module the checkpoint kept in bf16
        if not self.has(sname):
            raise ModelSourceError(f"{self.locate(wname)} has {wname} in float8_e4m3fn but "
                                   f"lacks {sname} (one scale per 128x128 block)")
        s = self.get(sname)
        bn, bk = self.quant.block
        n, k = w.shape
        want = (-(-n // bn), -(-k // bk))
        if s.dim() != 2 or tuple(s.shape) != want:
            raise self._bad(sname, f"has shape {tuple(s.shape)}; {bn}x{bk} blocks of the "
                            f"{n}x{k} weight need {want} (wrong block size?)")
        if not s.dtype.is_floating_point:
            raise self._bad(sname, f"is {s.dtype}: expected a float scale")
        return Fp8Linear(w, s.to(torch.float32), (bn, bk))

    def _int4(self, prefix: str, lay: str) -> Weight:
        g = self.quant.group
        qw = self.get(prefix + ".qweight")
        qz = self._need(prefix + ".qzeros", f"{lay} checkpoints carry qzeros per projection")
        sc = self._need(prefix + ".scales", f"{lay} checkpoints carry scales per projection")
        for name, t in ((".qweight", qw), (".qzeros", qz)):
            if t.dtype != torch.int32:
                raise self._bad(prefix + name, f"is {t.dtype}: expected int32")
        if lay == "awq":
            k, n = qw.shape[0], qw.shape[1] * 8
        else:
            k, n = qw.shape[0] * 8, qw.shape[1]
        if k % g:
            raise self._bad(prefix + ".qweight", f"has {k} input columns, not a multiple of "
                            f"group_size {g}")
        if tuple(sc.shape) != (k // g, n) or tuple(qz.shape) != (k // g, n // 8):
            raise self._bad(prefix + ".scales", f"{tuple(sc.shape)} / qzeros "
                            f"{tuple(qz.shape)} do not fit a {n}x{k} weight in groups of {g} "
                            "(wrong group_size?)")
        if lay == "awq":
            return from_awq(qw, qz, sc, g)
        gname = prefix + ".g_idx"
        if self.has(gname):
            gi = self.get(gname).to(torch.int64).cpu()
            if not torch.equal(gi, torch.arange(k) // g):
                raise self._bad(gname, "is not sequential: act-order GPTQ is not supported")
        return from_gptq(qw, qz, sc, g, self.quant.zero_offset)


# ---- writing quantized checkpoints (qwen-trt quantize) -----------------------------------

def model_group(hf: dict, group: int = INT4_GROUP) -> int:
    """:func:`~qwen_trt.fast.model.qformats.group_for` of a ``config.json``'s projection widths."""
    heads = hf["num_attention_heads"]
    widths = [hf["hidden_size"], hf["intermediate_size"],
              heads * hf.get("head_dim", hf["hidden_size"] // heads)]
    try:
        return group_for(widths, group)
    except ValueError as e:
        raise ModelSourceError(str(e)) from None


def quantize_checkpoint(src: str | Path, dst: str | Path, method: str, *,
                        layout: str = "awq", group: int = INT4_GROUP,
                        device: str = "cpu", log=print) -> Path:
    """Write ``src`` (a bf16/fp16/fp32 safetensors checkpoint) to ``dst`` with its projections
    quantized: ``fp8`` (Qwen's block FP8: bf16 ``weight_scale_inv``), or ``int4`` by round to
    nearest in the ``awq`` or ``gptq`` layout. Everything else (embedding, norms, LM head,
    tokenizer files) is copied unchanged."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ModelSourceError(f"'{src}' has no config.json")
    hf = json.loads(cfg_path.read_text())
    if hf.get("quantization_config"):
        raise ModelSourceError(f"{cfg_path} is already quantized "
                               f"({hf['quantization_config'].get('quant_method')})")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"'{src}' has no *.safetensors files")
    if method not in ("fp8", "int4") or layout not in ("awq", "gptq"):
        raise ValueError(f"quantize: method {method!r} / layout {layout!r}")
    dst.mkdir(parents=True, exist_ok=True)
    if method == "int4":
        group = model_group(hf, group)
    projections = tuple(p for parts in PARTS.values() for p in parts)
    weight_map: dict[str, str] = {}
    n_packed = 0
    for f in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(f), framework="pt", device=device) as h:
            for name in h.keys():
                t = h.get_tensor(name)
                stem = name[:-len(".weight")] if name.endswith(".weight") else None
                if stem and stem.startswith("model.layers.") and stem.endswith(projections):
                    n_packed += 1
                    if method == "fp8":
                        q, s = fp8_quantize(t, FP8_BLOCK, scale_dtype=torch.bfloat16)
                        out[name], out[stem + ".weight_scale_inv"] = q, s
                    else:
                        p = quantize(t, QuantSpec("int4", group=group))
                        parts = to_awq(p) if layout == "awq" else to_gptq(p)
                        out.update({f"{stem}.{k}": v for k, v in parts.items()})
                else:
                    out[name] = t
        save_file({k: v.cpu().contiguous() for k, v in out.items()}, str(dst / f.name),
                  metadata={"format": "pt"})
        weight_map.update({k: f.name for k in out})
    if len(files) > 1:
        (dst / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    if method == "fp8":
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK)}
    elif layout == "awq":
        hf["quantization_config"] = {"quant_method": "awq", "version": "gemm", "bits": 4,
                                     "group_size": group, "zero_point": True}
    else:
        hf["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group,
                                     "desc_act": False, "sym": False,
                                     "checkpoint_format": "gptq"}
    (dst / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                "config.json", "model.safetensors.index.json") and not (dst / extra.name).exists():
            shutil.copy(extra, dst / extra.name)
    log(f"quantized {n_packed} projections to {method}"
        + (f" ({layout} layout, group {group}, round to nearest)" if method == "int4" else
           " (128x128 blocks)") + f": {dst}")
    return dst
