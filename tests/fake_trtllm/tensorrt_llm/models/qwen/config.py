"""Fake ``tensorrt_llm.models.qwen.config.QWenConfig`` in two flavours (``FLAVOUR``).

How the converter finds the attention head size, as read upstream (NVIDIA/TensorRT-LLM):

* ``"1.2"`` (later mains): ``head_dim = getattr(hf_config, "head_dim", hidden // heads)`` then
  ``head_size = getattr(hf_config, "kv_channels", head_dim)``:
  tensorrt_llm/models/qwen/config.py:112-115 @0428c188, :118-121 @373970a8.
* ``"1.0rc3"`` (the first Qwen3 engine support, PR #5650, shipped in 1.0.0rc3):
  ``head_dim = hidden_size // num_attention_heads`` then ``head_size = getattr(hf_config,
  "kv_channels", head_dim)`` -- the form quoted as "Current Implementation" in issue #5912 /
  PR #5913 and found in the pre-Qwen3 QWenConfig (config.py:90-91 of a 0.1x snapshot); so
  Qwen3-4B (hidden 2560 / 32 heads) gets 80 instead of 128 unless ``kv_channels`` is given.

Upstream reads the HF config with ``transformers.AutoConfig.from_pretrained``, which keeps unknown
keys such as ``kv_channels`` as attributes; the fake reads config.json directly.
"""
from __future__ import annotations

import json
from pathlib import Path

FLAVOUR = "1.2"
FLAVOURS = ("1.2", "1.0rc3")

QWEN_TYPES = ("qwen", "qwen2", "qwen2_moe", "qwen2_llava_onevision", "qwen2_vl", "qwen2_audio",
              "qwen3", "qwen3_moe")


def infer_dtype(dtype: str, torch_dtype) -> str:
    """tensorrt_llm/models/convert_utils.py infer_dtype: 'auto' -> the checkpoint's dtype,
    float32 -> float16."""
    if dtype == "auto":
        dtype = torch_dtype or "float16"
        if dtype == "float32":
            dtype = "float16"
    return dtype


class QWenConfig:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        m = out.get("mapping")
        if m is not None and not isinstance(m, dict):
            out["mapping"] = {"world_size": m.world_size, "tp_size": m.tp_size,
                              "pp_size": m.pp_size, "rank": m.rank}
        return out

    @classmethod
    def from_hugging_face(cls, hf_config_or_dir, dtype="auto", mapping=None, quant_config=None,
                          **kwargs) -> "QWenConfig":
        assert FLAVOUR in FLAVOURS, FLAVOUR
        hf = json.loads((Path(hf_config_or_dir) / "config.json").read_text())
        qwen_type = hf["model_type"]
        assert qwen_type in QWEN_TYPES, (f"Unsupported Qwen type: {qwen_type}, only "
                                         f"{QWEN_TYPES} are acceptable.")
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        if FLAVOUR == "1.0rc3":
            head_dim = hidden // heads
        else:
            head_dim = hf.get("head_dim", hidden // heads)
        head_size = hf.get("kv_channels", head_dim)
        if mapping is None:
            from tensorrt_llm.mapping import Mapping
            mapping = Mapping()
        return cls(
            architecture=hf["architectures"][0],
            dtype=infer_dtype(dtype, hf.get("torch_dtype")),
            qwen_type=qwen_type, hidden_size=hidden, num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads", heads), head_size=head_size,
            vocab_size=hf["vocab_size"], intermediate_size=hf["intermediate_size"],
            # getattr(hf_config, "rope_theta", 100000.0): transformers 4.57 ignores the 5.x
            # "rope_parameters" key, so a 5.x-written config falls back to the default
            rotary_base=hf.get("rope_theta", 100000.0),
            max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            quantization=(quant_config.to_dict() if quant_config is not None
                          else {"quant_algo": None, "kv_cache_quant_algo": None}),
            mapping=mapping, **kwargs)
