"""Shape and numerics of a Qwen3 decoder, read from a Hugging Face ``config.json``."""
from __future__ import annotations

from dataclasses import dataclass

from qwen_trt.errors import ModelSourceError
from qwen_trt.model.shape import ModelShape


@dataclass(frozen=True)
class FastConfig:
    """Everything the compact model needs; nothing else from the HF config is used."""

    vocab_size: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    max_position_embeddings: int

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def n_params(self) -> int:
        """Parameter count (the tied embedding counted once), as HF reports it."""
        attn = self.hidden * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        norms = 2 * self.hidden + 2 * self.head_dim
        emb = self.vocab_size * self.hidden * (1 if self.tie_embeddings else 2)
        return self.layers * (attn + mlp + norms) + emb + self.hidden

    def kv_bytes_per_token(self, elem_size: int) -> int:
        return 2 * self.layers * self.kv_size * elem_size

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "config.json") -> "FastConfig":
        """Build from a parsed ``config.json`` (transformers 4.57 or 5.x layout); the shape
        (and its head_dim policy) comes from :class:`ModelShape`."""
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ModelSourceError(
                f"the fast path supports plain RoPE only, this checkpoint uses rope_type "
                f"'{rope_type}': load it with --fast off.")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if cfg.get("attention_bias"):
            raise ModelSourceError("the fast path does not support attention_bias: use --fast off.")
        if cfg.get("use_sliding_window"):
            raise ModelSourceError("the fast path does not support sliding-window attention: "
                                   "use --fast off.")
        s = ModelShape.from_config(cfg, where)
        return cls(
            vocab_size=s.vocab, hidden=s.hidden, intermediate=s.intermediate, layers=s.layers,
            heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
            rope_theta=float(theta),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=s.tied_embeddings,
            max_position_embeddings=s.max_positions or 32768,
        )

    def to_hf(self) -> dict:
        """The matching HF config dict (used to build a reference model with the same shapes)."""
        return {
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden,
            "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim, "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps, "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        }


# Qwen3-4B-Instruct-2507 (config.json of the hub checkpoint): 4,022,468,096 parameters.
QWEN3_4B = FastConfig(vocab_size=151936, hidden=2560, intermediate=9728, layers=36, heads=32,
                      kv_heads=8, head_dim=128, rope_theta=5_000_000.0, rms_eps=1e-6,
                      tie_embeddings=True, max_position_embeddings=262144)
# Same layout as the offline tiny checkpoint, for CPU smoke runs.
TINY = FastConfig(vocab_size=515, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                  head_dim=32, rope_theta=5_000_000.0, rms_eps=1e-6, tie_embeddings=True,
                  max_position_embeddings=4096)
SHAPES = {"qwen3-4b": QWEN3_4B, "tiny": TINY}
