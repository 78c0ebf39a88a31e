"""Fill a :class:`Qwen3Fast` with weights: from HF safetensors files, from a loaded HF model's
state dict, or random (benchmarks without a checkpoint). q/k/v and gate/up are concatenated."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from qwen_trt.errors import ModelSourceError
from qwen_trt.fast.model import Qwen3Fast

Getter = Callable[[str], torch.Tensor]


def _fill(model: Qwen3Fast, get: Getter) -> None:
    """Copy every weight of ``model`` from ``get(hf_name)`` (any dtype/device)."""

    def put(dst: torch.Tensor, *names: str) -> None:
        parts = [get(n) for n in names]
        src = parts[0] if len(parts) == 1 else torch.cat([p.to(dst.device) for p in parts], dim=0)
        if tuple(src.shape) != tuple(dst.shape):
            raise ModelSourceError(f"weight {names[0]} has shape {tuple(src.shape)}, expected "
                                   f"{tuple(dst.shape)}: config.json does not match the weights.")
        dst.copy_(src)

    with torch.no_grad():
        put(model.embed, "model.embed_tokens.weight")
        put(model.ln_final, "model.norm.weight")
        if not model.cfg.tie_embeddings:
            put(model.lm_head, "lm_head.weight")
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            put(layer.wqkv, p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                p + "self_attn.v_proj.weight")
            put(layer.wo, p + "self_attn.o_proj.weight")
            put(layer.w_gate_up, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            put(layer.w_down, p + "mlp.down_proj.weight")
            put(layer.ln_in, p + "input_layernorm.weight")
            put(layer.ln_post, p + "post_attention_layernorm.weight")
            put(layer.q_norm, p + "self_attn.q_norm.weight")
            put(layer.k_norm, p + "self_attn.k_norm.weight")


def load_safetensors(model: Qwen3Fast, folder: str | Path) -> None:
    """Read the checkpoint's ``*.safetensors`` straight onto the model's device."""
    from safetensors import safe_open

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"'{folder}' has no *.safetensors files: the fast path needs them.")
    index = folder / "model.safetensors.index.json"
    where: dict[str, Path] = {}
    if index.is_file():
        for name, file in json.loads(index.read_text())["weight_map"].items():
            where[name] = folder / file
    handles = {}
    device = str(model.device)

    def get(name: str) -> torch.Tensor:
        path = where.get(name)
        candidates = [path] if path else files
        for f in candidates:
            h = handles.get(f)
            if h is None:
                h = handles[f] = safe_open(str(f), framework="pt", device=device)
            if name in h.keys():
                return h.get_tensor(name)
        raise ModelSourceError(f"'{folder}' lacks the weight {name}: the checkpoint is incomplete.")

    _fill(model, get)


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
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.startswith(("cache.", "cos", "sin")):
                continue
            if b.dim() == 1:
                b.fill_(1.0)
            else:
                b.normal_(0.0, std, generator=g)
