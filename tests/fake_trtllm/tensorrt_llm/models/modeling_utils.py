"""Fake ``tensorrt_llm.models.modeling_utils.QuantConfig`` (a dataclass upstream with
``quant_algo``, ``kv_cache_quant_algo``, ``group_size=128``, ``smoothquant_val``,
``has_zero_point``, ``pre_quant_scale``, ``exclude_modules`` and the
``_requires_modelopt_quantization`` property; tensorrt_llm/models/modeling_utils.py, stored
snapshot). An unknown keyword is a TypeError, as with the dataclass."""
from __future__ import annotations

from dataclasses import dataclass

from tensorrt_llm.quantization import MODELOPT_FLOW, QuantAlgo


@dataclass
class QuantConfig:
    quant_algo: QuantAlgo | None = None
    kv_cache_quant_algo: QuantAlgo | None = None
    group_size: int = 128
    smoothquant_val: float = 0.5
    clamp_val: list | None = None
    use_meta_recipe: bool = False
    has_zero_point: bool = False
    pre_quant_scale: bool = False
    exclude_modules: list | None = None

    def __post_init__(self):
        for name in ("quant_algo", "kv_cache_quant_algo"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, QuantAlgo):
                raise TypeError(f"{name} must be a QuantAlgo, got {v!r}")

    @property
    def _requires_modelopt_quantization(self) -> bool:
        return self.quant_algo in MODELOPT_FLOW

    def to_dict(self) -> dict:
        return {"quant_algo": self.quant_algo.value if self.quant_algo else None,
                "kv_cache_quant_algo": (self.kv_cache_quant_algo.value
                                        if self.kv_cache_quant_algo else None),
                "group_size": self.group_size, "has_zero_point": self.has_zero_point,
                "pre_quant_scale": self.pre_quant_scale, "exclude_modules": self.exclude_modules}
