"""Fake ``tensorrt_llm.models``: ``QWenForCausalLM`` and ``MODEL_MAP``.

* ``QWenForCausalLM.from_hugging_face(hf_model_or_dir, dtype='auto', mapping=None,
  quant_config=None, **kwargs)``: tensorrt_llm/models/qwen/model.py @04a2cacb.
* ``QWenConfig.from_hugging_face`` reads ``head_dim = getattr(hf_config, 'head_dim',
  hidden // heads)``, ``rotary_base = getattr(hf_config, 'rope_theta', 100000.0)``, qwen_type
  from model_type (qwen3 allowed in 1.x): tensorrt_llm/models/qwen/config.py @0428c188.
* ``save_checkpoint(output_dir, save_config=True)`` writes rank0.safetensors and config.json
  into an existing folder (it does not create it); ``from_checkpoint(ckpt_dir, rank=None,
  config=None, *, preprocess_weights_hook=None)`` reads them (PretrainedModel in
  tensorrt_llm/models/modeling_utils.py, stored snapshot).
* ``MODEL_MAP`` maps HF architectures to classes, with 'Qwen3ForCausalLM' (models/__init__.py).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import tensorrt_llm

QWEN_TYPES = ("qwen", "qwen2", "qwen2_moe", "qwen2_llava_onevision", "qwen2_vl", "qwen2_audio",
              "qwen3", "qwen3_moe")


class QWenForCausalLM:
    def __init__(self, config: dict, weights_file: Path | None = None):
        self.config = config
        self._weights = weights_file

    @classmethod
    def from_hugging_face(cls, hf_model_or_dir, dtype="auto", mapping=None, quant_config=None,
                          **kwargs):
        tensorrt_llm.CALLS.append(("from_hugging_face", {"dir": str(hf_model_or_dir),
                                                         "dtype": dtype, "mapping": mapping,
                                                         **kwargs}))
        hf = json.loads((Path(hf_model_or_dir) / "config.json").read_text())
        qwen_type = hf["model_type"]
        assert qwen_type in QWEN_TYPES, f"Unsupported Qwen type: {qwen_type}"
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        config = {
            "architecture": hf["architectures"][0], "dtype": dtype, "qwen_type": qwen_type,
            "hidden_size": hidden, "num_hidden_layers": hf["num_hidden_layers"],
            "num_attention_heads": heads, "num_key_value_heads": hf["num_key_value_heads"],
            "head_size": hf.get("head_dim", hidden // heads), "vocab_size": hf["vocab_size"],
            # config.py: getattr(hf_config, "rope_theta", 100000.0); transformers 4.57 ignores
            # the 5.x "rope_parameters" key, so a 5.x-written config falls back to the default
            "rotary_base": hf.get("rope_theta", 100000.0),
            "max_position_embeddings": hf["max_position_embeddings"],
            "mapping": {"world_size": mapping.world_size if mapping else 1,
                        "tp_size": mapping.tp_size if mapping else 1,
                        "pp_size": mapping.pp_size if mapping else 1,
                        "rank": mapping.rank if mapping else 0},
        }
        weights = sorted(Path(hf_model_or_dir).glob("*.safetensors"))
        return cls(config, weights[0] if weights else None)

    def save_checkpoint(self, output_dir, save_config=True):
        tensorrt_llm.CALLS.append(("save_checkpoint", {"dir": str(output_dir)}))
        if not os.path.isdir(output_dir):   # like safetensors.torch.save_file into a missing dir
            raise FileNotFoundError(f"No such file or directory: '{output_dir}/rank0.safetensors'")
        if save_config:
            Path(output_dir, "config.json").write_text(json.dumps(self.config, indent=2))
        rank = self.config["mapping"]["rank"]
        dest = Path(output_dir, f"rank{rank}.safetensors")
        if self._weights is not None:
            shutil.copyfile(self._weights, dest)
        else:
            dest.write_bytes(b"")

    @classmethod
    def from_checkpoint(cls, ckpt_dir, rank=None, config=None, *, preprocess_weights_hook=None):
        tensorrt_llm.CALLS.append(("from_checkpoint", {"dir": str(ckpt_dir)}))
        cfg = json.loads(Path(ckpt_dir, "config.json").read_text())
        return cls(cfg, Path(ckpt_dir, f"rank{rank or 0}.safetensors"))


MODEL_MAP = {
    "QWenForCausalLM": QWenForCausalLM,
    "Qwen2ForCausalLM": QWenForCausalLM,
    "Qwen3ForCausalLM": QWenForCausalLM,
    "Qwen3MoeForCausalLM": QWenForCausalLM,
}
