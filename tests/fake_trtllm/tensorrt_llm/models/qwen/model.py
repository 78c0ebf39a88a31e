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
* Quantization: ``from_hugging_face(quant_config=QuantConfig(W8A16 | W4A16))`` quantizes the
  linear weights while converting (the native flow; the fake stores them as int8, two INT4
  values a byte), and refuses a ModelOpt algorithm (FP8, W4A16_AWQ), which only
  ``quantize(hf_model_dir, output_dir, dtype, mapping, quant_config, *, device='cuda',
  calib_dataset='cnn_dailymail', calib_batches=512, calib_batch_size=1,
  calib_max_seq_length=512, random_seed=1234, tokenizer_max_seq_length=2048)`` runs: it
  calibrates on ``calib_dataset`` and writes the checkpoint into ``output_dir``
  (PretrainedModel.quantize, tensorrt_llm/models/modeling_utils.py, stored snapshot; the fake
  writes 8-bit / 4-bit packed int8 weights and records the calibration arguments).
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


def _is_linear(name: str, t) -> bool:
    return t.dim() == 2 and "embedding" not in name and not name.startswith("lm_head")


def _pack(t, bits: int):
    """Stand-in for quantized storage: one int8 per weight, or two INT4 weights per byte."""
    q = t.float().clamp(-1, 1).mul(127).round().to(torch.int8)
    return q if bits == 8 else q[:, : q.shape[1] // 2].contiguous()


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
        from_quantize = kwargs.pop("_from_quantize", False)
        tensorrt_llm.CALLS.append(("from_hugging_face", {"dir": str(hf_model_or_dir),
                                                         "dtype": dtype, "mapping": mapping,
                                                         "quant_config": quant_config,
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
        if quant_config is not None and quant_config.quant_algo is not None:
            if quant_config._requires_modelopt_quantization and not from_quantize:
                raise ValueError(f"{quant_config.quant_algo} needs calibration: use "
                                 f"QWenForCausalLM.quantize (ModelOpt)")
            bits = 4 if "W4" in quant_config.quant_algo.value else 8
            weights = {k: _pack(v, bits) if _is_linear(k, v) else v for k, v in weights.items()}
        model.weights = weights
        return model

    @classmethod
    def quantize(cls, hf_model_dir, output_dir, dtype="auto", mapping=None, quant_config=None, *,
                 device="cuda", calib_dataset="cnn_dailymail", calib_batches=512,
                 calib_batch_size=1, calib_max_seq_length=512, random_seed=1234,
                 tokenizer_max_seq_length=2048, **kwargs):
        tensorrt_llm.CALLS.append(("quantize", {
            "dir": str(hf_model_dir), "output_dir": str(output_dir), "dtype": dtype,
            "quant_config": quant_config, "calib_dataset": calib_dataset,
            "calib_batches": calib_batches, "calib_max_seq_length": calib_max_seq_length}))
        if quant_config is None or not quant_config._requires_modelopt_quantization:
            model = cls.from_hugging_face(hf_model_dir, dtype=dtype, mapping=mapping,
                                          quant_config=quant_config, **kwargs)
        else:
            model = cls.from_hugging_face(hf_model_dir, dtype=dtype, mapping=mapping,
                                          quant_config=quant_config, _from_quantize=True,
                                          **kwargs)
        os.makedirs(output_dir, exist_ok=True)
        model.save_checkpoint(output_dir, save_config=True)

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
