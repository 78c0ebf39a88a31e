"""Fill a :class:`Qwen3Fast` with weights: from HF safetensors files, from a loaded HF model's
state dict, or random (benchmarks without a checkpoint). q/k/v and gate/up are concatenated."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from qwen_trt.errors import ModelSourceError
from qwen_trt.fast.model.model import Qwen3Fast, projection_shapes
from qwen_trt.fast.model.qcheckpoint import (PARTS, CheckpointQuant, ProjectionReader,
                                       read_quant_config)
from qwen_trt.fast.model.qformats import PackedLinear, Weight, fuse, quantize
from qwen_trt.fast.kernels.linear import dense

Getter = Callable[[str], torch.Tensor]
ProjGetter = Callable[[str], Weight]


def _fill(model: Qwen3Fast, get: Getter, get_proj: ProjGetter | None = None) -> None:
    """Copy every weight of ``model`` from ``get(hf_name)`` (any dtype/device). Projections
    come from ``get_proj(hf_prefix)`` (default: ``get(prefix + ".weight")``): dense tensors or
    packed ones, fused and held in the model's format (``model.quant``: dense ones are
    quantized as they load, packed ones dequantized when the model is dense)."""
    get_proj = get_proj or (lambda prefix: get(prefix + ".weight"))
    spec, dtype, device = model.quant, model.dtype, model.device
    shapes = projection_shapes(model.cfg)

    def put(dst: torch.Tensor, *names: str) -> None:
        parts = [get(n) for n in names]
        src = parts[0] if len(parts) == 1 else torch.cat([p.to(dst.device) for p in parts], dim=0)
        if tuple(src.shape) != tuple(dst.shape):
            raise ModelSourceError(f"weight {names[0]} has shape {tuple(src.shape)}, expected "
                                   f"{tuple(dst.shape)}: config.json does not match the weights.")
        dst.copy_(src)

    def put_proj(layer, attr: str, prefix: str) -> None:
        names = [prefix + part for part in PARTS[attr]]
        parts = [get_proj(n) for n in names]
        if spec.method == "none":
            parts = [dense(p, dtype).to(device, dtype) if isinstance(p, PackedLinear) else p
                     for p in parts]
        else:
            parts = [quantize(p.to(device, dtype), spec) if isinstance(p, torch.Tensor)
                     else p.to(device) for p in parts]
        for p, n in zip(parts, names):
            if isinstance(p, PackedLinear) and p.fmt != spec.method:
                raise ModelSourceError(f"{n} is {p.fmt} but the model loads as {spec.method}")
        fused = fuse(parts, dtype)
        if tuple(fused.shape) != shapes[attr]:
            raise ModelSourceError(f"weight {names[0]} fuses to shape {tuple(fused.shape)}, "
                                   f"expected {shapes[attr]}: config.json does not match the "
                                   "weights.")
        if isinstance(fused, torch.Tensor) and spec.method == "none":
            getattr(layer, attr).copy_(fused)
        else:
            layer.set_projection(attr, fused.to(device, dtype) if isinstance(fused, torch.Tensor)
                                 else fused)

    with torch.no_grad():
        put(model.embed, "model.embed_tokens.weight")
        put(model.ln_final, "model.norm.weight")
        if not model.cfg.tie_embeddings:
            put(model.lm_head, "lm_head.weight")
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            for attr in PARTS:
                put_proj(layer, attr, p)
            put(layer.ln_in, p + "input_layernorm.weight")
            put(layer.ln_post, p + "post_attention_layernorm.weight")
            put(layer.q_norm, p + "self_attn.q_norm.weight")
            put(layer.k_norm, p + "self_attn.k_norm.weight")


def checkpoint_quant(folder: str | Path) -> CheckpointQuant:
    """What ``folder/config.json`` says about quantization (none when it has no config)."""
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return CheckpointQuant()
    try:
        hf = json.loads(cfg.read_text())
    except ValueError as e:
        raise ModelSourceError(f"{cfg} is not valid JSON: {e}") from None
    return read_quant_config(hf, str(cfg))


def load_safetensors(model: Qwen3Fast, folder: str | Path) -> None:
    """Read the checkpoint's ``*.safetensors`` straight onto the model's device, in the format
    its ``config.json`` names (:mod:`qwen_trt.fast.model.qcheckpoint`)."""
    from safetensors import safe_open

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"'{folder}' has no *.safetensors files: the fast path needs them.")
    quant = checkpoint_quant(folder)
    index = folder / "model.safetensors.index.json"
    where: dict[str, Path] = {}
    if index.is_file():
        for name, file in json.loads(index.read_text())["weight_map"].items():
            where[name] = folder / file
    handles = {}
    device = str(model.device)

    def handle(f: Path):
        h = handles.get(f)
        if h is None:
            h = handles[f] = safe_open(str(f), framework="pt", device=device)
        return h

    def find(name: str) -> Path | None:
        path = where.get(name)
        for f in [path] if path else files:
            if name in handle(f).keys():
                return f
        return None

    def has(name: str) -> bool:
        return find(name) is not None

    def locate(name: str) -> str:
        f = find(name) or where.get(name)
        return f"'{f}'" if f else f"'{folder}'"

    def get(name: str) -> torch.Tensor:
        f = find(name)
        if f is None:
            raise ModelSourceError(f"'{folder}' lacks the weight {name}: the checkpoint is "
                                   "incomplete.")
        return handle(f).get_tensor(name)

    reader = ProjectionReader(quant, get, has, locate)
    _fill(model, get, reader.read)


def load_state_dict(model: Qwen3Fast, state: dict[str, torch.Tensor]) -> None:
    """From an HF ``Qwen3ForCausalLM.state_dict()`` (shares nothing: weights are copied)."""

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ModelSourceError(f"state dict lacks {name}")
        return state[name]

    _fill(model, get)


def init_random(model: Qwen3Fast, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place (on the model's device): normal(0, std) matrices, unit norms."""
    g = torch.Generator(device=model.device)
    g.manual_seed(seed)
    shapes = projection_shapes(model.cfg)
    with torch.no_grad():
        # the dense model's buffer order: a packed model draws the same numbers, then packs them
        for name, b in list(model.named_buffers()):
            if name.startswith(("cache.", "cos", "sin")):
                continue
            attr = name.rsplit(".", 1)[-1]
            if b.numel() == 0 and attr in shapes:      # a packed projection's placeholder
                layer = model.layers[int(name.split(".")[1])]
                w = torch.empty(shapes[attr], dtype=model.dtype, device=model.device)
                layer.set_projection(attr, quantize(w.normal_(0.0, std, generator=g),
                                                    model.quant))
            elif b.dim() == 1:
                b.fill_(1.0)
            else:
                b.normal_(0.0, std, generator=g)
