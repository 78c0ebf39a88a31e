"""Fake ``tensorrt_llm.models``: ``QWenForCausalLM`` (models/qwen/model.py), ``QWenConfig``
(models/qwen/config.py, two converter flavours) and ``MODEL_MAP`` mapping HF architectures to
classes, with 'Qwen3ForCausalLM' (models/__init__.py)."""
from tensorrt_llm.models.qwen.config import QWenConfig  # noqa: F401
from tensorrt_llm.models.qwen.model import QWenForCausalLM

MODEL_MAP = {
    "QWenForCausalLM": QWenForCausalLM,
    "Qwen2ForCausalLM": QWenForCausalLM,
    "Qwen3ForCausalLM": QWenForCausalLM,
    "Qwen3MoeForCausalLM": QWenForCausalLM,
}
