"""Fake ``tensorrt_llm.models.qwen.model.QWenForCausalLM``.

* ``from_hugging_face(hf_model_or_dir, dtype='auto', mapping=None, quant_config=None,
  **kwargs)`` builds ``QWenConfig.from_hugging_face`` first, then the model, then loads the
  weights into parameters shaped by that config (tensorrt_llm/models/qwen/model.py). A wrong
  head size fails like upstream's ``Parameter.value`` setter: ``AssertionError: The value updated
  is not the same shape as the original. Updated: (6144, 2560), original: (3840, 2560)`` (the
  message users reported on Qwen3-4B in PR #5650 / issue #5912).
* Tied embeddings (Qwen3-4B has no ``lm_head.weight``): the qwen3 branch passes no lm_head
  mapping, and ``ModelWeightsLoader.update_key_mapping`` points ``lm_head`` at
  ``model.embed_tokens`` (tensorrt_llm/models/model_weights_loader.py @7eb710fa), so
  ``lm_head.weight`` becomes a second parameter holding a copy of the embedding. The fake's
  checkpoint holds both, as upstream's does.
* ``save_checkpoint(output_dir, save_config=True)`` writes rank0.safetensors and config.json into
  an existing folder (it does not create it); ``from_checkpoint(ckpt_dir, rank=None, config=None,
  *, preprocess_weights_hook=None)`` reads them (PretrainedModel, modeling_utils.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

import tensorrt_llm
from tensorrt_llm.models.qwen.config import QWenConfig

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _hf_tensors(hf_dir: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


class QWenForCausalLM:
    config_class = QWenConfig

    def __init__(self, config: QWenConfig, weights: dict | None = None):
        self.config = config
        self.weights = weights or {}

    def _shapes(self) -> dict:
        c = self.config
        qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_size
        return {"qkv": (qkv, c.hidden_size),
                "dense": (c.hidden_size, c.num_attention_heads * c.head_size)}

    @classmethod
    def from_hugging_face(cls, hf_model_or_dir, dtype="auto", mapping=None, quant_config=None,
                          **kwargs):
        tensorrt_llm.CALLS.append(("from_hugging_face", {"dir": str(hf_model_or_dir),
                                                         "dtype": dtype, "mapping": mapping,
                                                         **kwargs}))
        config = QWenConfig.from_hugging_face(hf_model_or_dir, dtype=dtype, mapping=mapping,
                                              quant_config=quant_config, **kwargs)
        model = cls(config)
        hf = _hf_tensors(Path(hf_model_or_dir))
        want = model._shapes()
        torch_dtype = _DTYPES[config.dtype]
        fused = {f"model.layers.{i}.self_attn.{n}_proj.weight"
                 for i in range(config.num_hidden_layers) for n in "qkv"}
        # every other tensor is converted as it is (names do not matter to the fake)
        weights = {k: v.to(torch_dtype) for k, v in hf.items()
                   if k not in fused and k not in ("model.embed_tokens.weight", "lm_head.weight")}
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}.self_attn."
            if p + "q_proj.weight" not in hf:
                continue
            qkv = torch.cat([hf[p + n + "_proj.weight"] for n in ("q", "k", "v")])
            for name, value in (("qkv", qkv), ("dense", hf[p + "o_proj.weight"])):
                assert tuple(value.shape) == want[name], (
                    f"The value updated is not the same shape as the original. Updated: "
                    f"{tuple(value.shape)}, original: {want[name]}")
            weights[f"transformer.layers.{i}.attention.qkv.weight"] = qkv.to(torch_dtype)
        embed = hf.get("model.embed_tokens.weight")
        if embed is not None:
            weights["transformer.vocab_embedding.weight"] = embed.to(torch_dtype)
            head = hf.get("lm_head.weight", embed)   # update_key_mapping: lm_head -> embed_tokens
            weights["lm_head.weight"] = head.to(torch_dtype).clone()
        model.weights = weights
        return model

    def save_checkpoint(self, output_dir, save_config=True):
        from safetensors.torch import save_file

        tensorrt_llm.CALLS.append(("save_checkpoint", {"dir": str(output_dir)}))
        if not os.path.isdir(output_dir):   # like safetensors.torch.save_file into a missing dir
            raise FileNotFoundError(f"No such file or directory: '{output_dir}/rank0.safetensors'")
        if save_config:
            Path(output_dir, "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        rank = self.config.mapping.rank
        save_file({k: v.contiguous() for k, v in self.weights.items()},
                  str(Path(output_dir, f"rank{rank}.safetensors")))

    @classmethod
    def from_checkpoint(cls, ckpt_dir, rank=None, config=None, *, preprocess_weights_hook=None):
        from safetensors.torch import load_file

        tensorrt_llm.CALLS.append(("from_checkpoint", {"dir": str(ckpt_dir)}))
        cfg = json.loads(Path(ckpt_dir, "config.json").read_text())
        from tensorrt_llm.mapping import Mapping

        m = cfg.get("mapping") or {}
        cfg["mapping"] = Mapping(world_size=m.get("world_size", 1), rank=m.get("rank", 0),
                                 tp_size=m.get("tp_size", 1), pp_size=m.get("pp_size", 1))
        weights = load_file(str(Path(ckpt_dir, f"rank{rank or 0}.safetensors")))
        return cls(QWenConfig(**cfg), weights)
