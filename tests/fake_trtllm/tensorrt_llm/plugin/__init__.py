"""Fake ``tensorrt_llm.plugin.PluginConfig``.

Field names as in tensorrt_llm/plugin/plugin.py (@035b99e0 dataclass; a pydantic model in 1.x),
defaults as the 1.x docs describe them: gpt_attention_plugin "auto", gemm_plugin None (off),
remove_input_padding True, context_fmha True, paged_kv_cache None (resolved by
BuildConfig.update_kv_cache_type), use_paged_context_fmha True, tokens_per_block 32.
Like the pydantic model, unknown attributes and bad values are rejected on assignment.
"""
from dataclasses import asdict, dataclass

_PLUGIN_DTYPES = ("auto", "float16", "float32", "bfloat16", None)


@dataclass
class PluginConfig:
    dtype: str = "float16"
    gpt_attention_plugin: str | None = "auto"
    gemm_plugin: str | None = None
    remove_input_padding: bool = True
    context_fmha: bool = True
    paged_kv_cache: bool | None = None
    use_paged_context_fmha: bool = True
    tokens_per_block: int = 32
    paged_state: bool = False

    def __setattr__(self, name, value):
        if name not in self.__dataclass_fields__:
            raise AttributeError(f"PluginConfig has no field {name!r}")
        if name.endswith("_plugin") and value not in _PLUGIN_DTYPES:
            raise ValueError(f"{name}: {value!r} not in {_PLUGIN_DTYPES}")
        object.__setattr__(self, name, value)

    def to_dict(self):
        return asdict(self)
