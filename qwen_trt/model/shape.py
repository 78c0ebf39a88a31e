"""The shape of a Qwen3 decoder, read once from a Hugging Face ``config.json`` (or its dict).

Every reader of a config's shape uses :class:`ModelShape`: the checkpoint check
(:mod:`qwen_trt.model.source`), the engine build's shape check, the fast path's ``FastConfig``
and the ONNX export's graph signature.

Policy for ``head_dim`` (one, everywhere): the value written in config.json is used as is;
only when the config omits it (or writes null) is it ``hidden_size // num_attention_heads`` --
transformers' own fallback. Qwen3 writes it explicitly, and for Qwen3-4B it is 128, not
2560 / 32 = 80 (the trap of NVIDIA/TensorRT-LLM#5912); the engine build refuses a Qwen3-4B-sized
config whose head_dim is not 128. ``num_key_value_heads`` likewise defaults to
``num_attention_heads`` when omitted.

A missing or wrong-typed field is one :class:`ConfigError` line naming the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qwen_trt.errors import ConfigError, ModelSourceError

_REQUIRED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
             "vocab_size")


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int           # 0 when the config does not say
    tied_embeddings: bool

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelShape":
        """Read and check the shape; ``where`` names the file in error messages."""
        if not isinstance(config, dict):
            raise ConfigError(f"{where} does not hold a JSON object.")

        def whole(key: str, default: Any = None) -> int:
            value = config.get(key)
            if value is None:
                if default is None:
                    raise ConfigError(f"{where} lacks '{key}': the checkpoint is incomplete.")
                return default
            if type(value) is not int or value <= 0:
                raise ConfigError(f"{where}: '{key}' must be a positive whole number, "
                                  f"got {value!r}.")
            return value

        for key in _REQUIRED:
            whole(key)
        hidden, heads = whole("hidden_size"), whole("num_attention_heads")
        tied = config.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise ConfigError(f"{where}: 'tie_word_embeddings' must be true or false, "
                              f"got {tied!r}.")
        shape = cls(layers=whole("num_hidden_layers"), hidden=hidden,
                    intermediate=whole("intermediate_size"), heads=heads,
                    kv_heads=whole("num_key_value_heads", heads),
                    head_dim=whole("head_dim", hidden // heads),
                    vocab=whole("vocab_size"),
                    max_positions=whole("max_position_embeddings", 0),
                    tied_embeddings=tied)
        if shape.heads % shape.kv_heads:
            raise ModelSourceError(f"{where}: num_attention_heads {shape.heads} is not a multiple "
                                   f"of num_key_value_heads {shape.kv_heads}.")
        return shape
