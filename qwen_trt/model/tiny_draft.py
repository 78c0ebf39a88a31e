"""Offline tiny random EAGLE-3 draft for a (tiny) Qwen3 checkpoint, in either published layout.

``qwen-trt tiny-draft DIR --target TINY_MODEL_DIR --layout sglang|speculators`` writes
``config.json`` and ``model.safetensors`` shaped for the target folder's ``config.json``: one
Llama-style layer of the target's hidden size (q/k/v over ``2 * hidden``), ``fc`` over three
aux hidden states, a draft vocabulary of a random subset of the target's tokens (``d2t`` /
``t2d``). The same seed gives the same tensors in both layouts (only names and config differ),
so tests can check that both load to the same model. Layouts: see
:mod:`qwen_trt.fast.spec.eagle3`.
"""
from __future__ import annotations

import json
from pathlib import Path

from qwen_trt.errors import FileProblemError, ModelSourceError
from qwen_trt.model.tiny import _prepare_folder

TINY_DRAFT_README_FIRST_LINE = ("Tiny random-weight EAGLE-3 draft written offline by "
                                "`qwen-trt tiny-draft`.")
DRAFT_LAYOUTS = ("sglang", "speculators")


def tiny_aux_layers(target_layers: int) -> tuple[int, ...]:
    """Aux layer ids (hidden entering those layers) for the tiny draft: EAGLE-3's default
    ``(2, L // 2, L - 3)`` where it fits, else spread over the few layers there are."""
    if target_layers >= 6:
        return (2, target_layers // 2, target_layers - 3)
    return (1, max(1, target_layers // 2), target_layers)


def _layer_config(t: dict, heads: int, kv_heads: int, intermediate: int) -> dict:
    hidden = t["hidden_size"]
    return {
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads, "hidden_act": "silu",
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6), "rope_theta": t.get("rope_theta", 10000.0),
        "max_position_embeddings": t.get("max_position_embeddings", 4096),
        "vocab_size": t["vocab_size"], "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }


def write_tiny_draft(out_dir: str | Path, target_dir: str | Path, layout: str = "sglang",
                     seed: int = 0, draft_vocab: int | None = None, *,
                     force: bool = False) -> Path:
    """Write the tiny draft for the checkpoint in ``target_dir`` into ``out_dir`` (new or
    empty, unless ``force``) and return it."""
    if layout not in DRAFT_LAYOUTS:
        raise ModelSourceError(f"draft layout {layout!r}: use {' or '.join(DRAFT_LAYOUTS)}.")
    try:
        t = json.loads((Path(target_dir) / "config.json").read_text())
        hidden, layers, vocab = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelSourceError(f"'{target_dir}' is not a Qwen3 checkpoint folder with a "
                               f"readable config.json ({type(e).__name__}).") from None
    draft_vocab = draft_vocab or min(256, vocab // 2)
    if not 1 <= draft_vocab <= vocab:
        raise ModelSourceError(f"--draft-vocab must be from 1 to the target's {vocab} tokens.")
    out = Path(out_dir)
    _prepare_folder(out, force)
    try:
        return _write(out, Path(target_dir), t, layout, seed, draft_vocab, hidden, layers,
                      vocab)
    except OSError as e:
        raise FileProblemError(f"Cannot write the tiny draft to {out}: "
                               f"{e.strerror or e}.") from e


def _write(out: Path, target_dir: Path, t: dict, layout: str, seed: int, draft_vocab: int,
           hidden: int, layers: int, vocab: int) -> Path:
    import torch
    from safetensors.torch import save_file

    heads, kv_heads, inter = 4, 2, 2 * hidden
    hd = hidden // heads
    aux = tiny_aux_layers(layers)
    g = torch.Generator().manual_seed(seed)

    def mat(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=g)

    layer = {
        "self_attn.q_proj.weight": mat(heads * hd, 2 * hidden),
        "self_attn.k_proj.weight": mat(kv_heads * hd, 2 * hidden),
        "self_attn.v_proj.weight": mat(kv_heads * hd, 2 * hidden),
        "self_attn.o_proj.weight": mat(hidden, heads * hd),
        "mlp.gate_proj.weight": mat(inter, hidden),
        "mlp.up_proj.weight": mat(inter, hidden),
        "mlp.down_proj.weight": mat(hidden, inter),
        "input_layernorm.weight": norm(),
        "hidden_norm.weight": norm(),
        "post_attention_layernorm.weight": norm(),
    }
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    state = {
        "fc.weight": mat(hidden, len(aux) * hidden, std=0.05),
        "norm.weight": norm(),
        "lm_head.weight": mat(draft_vocab, hidden, std=0.15),
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    lcfg = _layer_config(t, heads, kv_heads, inter)
    if layout == "sglang":
        state.update({"midlayer." + k: v for k, v in layer.items()})
        config = {"architectures": ["LlamaForCausalLMEagle3"], **lcfg,
                  "draft_vocab_size": draft_vocab,
                  # SGLang's convention: the layer whose OUTPUT is taken (one less)
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux],
                                   "use_aux_hidden_state": True}}
    else:
        state.update({"layers.0." + k: v for k, v in layer.items()})
        state["embed_tokens.weight"] = _target_embedding(target_dir, vocab, hidden)
        config = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0", "transformer_layer_config": lcfg,
            "draft_vocab_size": draft_vocab, "norm_before_residual": False,
            "target_hidden_size": hidden, "eagle_aux_hidden_state_layer_ids": list(aux),
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": str(target_dir),
                             "architectures": t.get("architectures", ["Qwen3ForCausalLM"])}},
            "torch_dtype": "float32"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "README.md").write_text(
        TINY_DRAFT_README_FIRST_LINE + f"\nLayout: {layout}. Target: {target_dir}.\n"
        "Random weights: it proposes tokens the target mostly rejects, by design.\n")
    return out


def _target_embedding(target_dir: Path, vocab: int, hidden: int):
    """The target's embedding table (the speculators converter stores the verifier's)."""
    import torch
    from safetensors import safe_open

    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            if "model.embed_tokens.weight" in h.keys():
                return h.get_tensor("model.embed_tokens.weight").float()
    return torch.zeros(vocab, hidden)
