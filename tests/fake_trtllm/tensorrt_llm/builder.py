"""Fake ``tensorrt_llm.builder``: ``BuildConfig``, ``build``, ``Engine.save``.

Mirrors tensorrt_llm/builder.py @008b2b8d: BuildConfig fields and defaults (max_input_len 1024,
max_seq_len None, max_batch_size 2048, max_beam_width 1, max_num_tokens 8192, kv_cache_type
None -> PAGED via update_kv_cache_type, plugin_config), ``build()`` deducing max_seq_len from
max_position_embeddings when it is None and clipping max_input_len to it, and ``Engine.save``
writing ``config.json`` ({"version", "pretrained_config", "build_config"}, KVCacheType written
as its name) plus ``rank{N}.engine``.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field

import tensorrt_llm
from tensorrt_llm.bindings import KVCacheType
from tensorrt_llm.plugin import PluginConfig


@dataclass
class BuildConfig:
    max_input_len: int = 1024
    max_seq_len: int | None = None
    opt_batch_size: int = 8
    max_batch_size: int = 2048
    max_beam_width: int = 1
    max_num_tokens: int = 8192
    opt_num_tokens: int | None = None
    max_prompt_embedding_table_size: int = 0
    kv_cache_type: KVCacheType | None = None
    gather_context_logits: bool = False
    gather_generation_logits: bool = False
    strongly_typed: bool = True
    use_refit: bool = False
    plugin_config: PluginConfig = field(default_factory=PluginConfig)
    dry_run: bool = False

    def __post_init__(self):
        if self.kv_cache_type is not None and not isinstance(self.kv_cache_type, KVCacheType):
            raise TypeError(f"kv_cache_type must be a KVCacheType, got {self.kv_cache_type!r}")
        if not isinstance(self.plugin_config, PluginConfig):
            raise TypeError("plugin_config must be a PluginConfig")

    def update_kv_cache_type(self, model_architecture: str) -> None:
        paged = self.plugin_config.paged_kv_cache
        if self.kv_cache_type is not None:
            if paged is not None:
                assert paged == (self.kv_cache_type == KVCacheType.PAGED)
            else:
                self.plugin_config.paged_kv_cache = self.kv_cache_type == KVCacheType.PAGED
        else:
            self.kv_cache_type = KVCacheType.PAGED if paged in (None, True) else KVCacheType.CONTINUOUS
            self.plugin_config.paged_kv_cache = self.kv_cache_type == KVCacheType.PAGED

    def to_dict(self):
        out = {k: copy.deepcopy(v) for k, v in self.__dict__.items() if k != "plugin_config"}
        out["kv_cache_type"] = self.kv_cache_type.name if self.kv_cache_type else None
        out["plugin_config"] = self.plugin_config.to_dict()
        return out


class EngineConfig:
    def __init__(self, pretrained_config: dict, build_config: BuildConfig, version: str):
        self.pretrained_config = pretrained_config
        self.build_config = build_config
        self.version = version

    def to_dict(self):
        bc = self.build_config.to_dict()
        bc.pop("dry_run", None)
        return {"version": self.version, "pretrained_config": self.pretrained_config,
                "build_config": bc}


class Engine:
    def __init__(self, config: EngineConfig, engine: bytes):
        self.config = config
        self.engine = engine

    def save(self, engine_dir: str):
        os.makedirs(engine_dir, exist_ok=True)
        rank = self.config.pretrained_config["mapping"]["rank"]
        if rank == 0:
            with open(os.path.join(engine_dir, "config.json"), "w") as f:
                json.dump(self.config.to_dict(), f, indent=4)
        with open(os.path.join(engine_dir, f"rank{rank}.engine"), "wb") as f:
            f.write(self.engine)


def build(model, build_config: BuildConfig) -> Engine:
    tensorrt_llm.CALLS.append(("build", {"build_config": build_config, "model": model}))
    build_config = copy.deepcopy(build_config)
    cfg = model.config
    build_config.plugin_config.dtype = cfg["dtype"]
    build_config.update_kv_cache_type(cfg["architecture"])
    if build_config.max_seq_len is None:
        build_config.max_seq_len = cfg["max_position_embeddings"]
    build_config.max_input_len = min(build_config.max_input_len, build_config.max_seq_len)
    plan = b"FAKEPLAN" + json.dumps(build_config.to_dict(), sort_keys=True).encode()
    return Engine(EngineConfig(dict(cfg), build_config, tensorrt_llm.__version__), plan)
