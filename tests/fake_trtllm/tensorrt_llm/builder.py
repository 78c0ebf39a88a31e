"""Fake ``tensorrt_llm.builder``: ``BuildConfig``, ``build``, ``Engine.save``.

Mirrors tensorrt_llm/builder.py @008b2b8d:

* BuildConfig fields and defaults (max_input_len 1024, max_seq_len None, max_batch_size 2048,
  max_beam_width 1, max_num_tokens 8192, opt_num_tokens None, kv_cache_type None -> PAGED via
  update_kv_cache_type, input_timing_cache None, **output_timing_cache 'model.cache'**,
  plugin_config);
* ``build()``: ``plugin_config.dtype = model.config.dtype``; ``_init_max_seq_len`` deduces
  max_seq_len from max_position_embeddings when it is None and clips max_input_len to it; then
  ``check_max_num_tokens`` (tensorrt_llm/_common.py) clips max_num_tokens to max_seq_len x
  max_batch_size and sets opt_num_tokens = min(max_batch_size x max_beam_width, max_num_tokens);
  at the end, when ``output_timing_cache`` is not None (rank 0) it writes the timing cache to that
  path -- relative paths land in the current directory -- and asserts it was saved;
* ``Engine.save`` writes ``config.json`` ({"version", "pretrained_config", "build_config"},
  KVCacheType written as its name) plus ``rank{N}.engine``.

The fake plan holds the model's weights (embedding and lm_head both, as upstream's network has
both parameters), so the engine file size tracks what a real engine stores.
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
    input_timing_cache: str | None = None
    output_timing_cache: str = "model.cache"
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
    def __init__(self, pretrained_config, build_config: BuildConfig, version: str):
        self.pretrained_config = pretrained_config
        self.build_config = build_config
        self.version = version

    def to_dict(self):
        bc = self.build_config.to_dict()
        bc.pop("dry_run", None)
        return {"version": self.version, "pretrained_config": self.pretrained_config.to_dict(),
                "build_config": bc}


class Engine:
    def __init__(self, config: EngineConfig, engine: bytes):
        self.config = config
        self.engine = engine

    def save(self, engine_dir: str):
        os.makedirs(engine_dir, exist_ok=True)
        rank = self.config.pretrained_config.mapping.rank
        if rank == 0:
            with open(os.path.join(engine_dir, "config.json"), "w") as f:
                json.dump(self.config.to_dict(), f, indent=4)
        with open(os.path.join(engine_dir, f"rank{rank}.engine"), "wb") as f:
            f.write(self.engine)


def check_max_num_tokens(max_num_tokens, opt_num_tokens, max_batch_size, max_input_len,
                         max_seq_len, max_beam_width, remove_input_padding, enable_context_fmha,
                         tokens_per_block):
    """tensorrt_llm/_common.py check_max_num_tokens (the remove_input_padding branch)."""
    if not remove_input_padding:
        return max_batch_size * max_seq_len, opt_num_tokens
    if max_num_tokens is None:
        max_num_tokens = max_seq_len * max_batch_size
    if opt_num_tokens is None:
        opt_num_tokens = min(max_batch_size * max_beam_width, max_num_tokens)
    if max_num_tokens > max_seq_len * max_batch_size:
        max_num_tokens = max_seq_len * max_batch_size
    if max_num_tokens < max_input_len and not enable_context_fmha:
        max_num_tokens = max_input_len
    elif max_num_tokens < tokens_per_block and enable_context_fmha:
        max_num_tokens = tokens_per_block
    if opt_num_tokens is not None and opt_num_tokens > max_num_tokens:
        opt_num_tokens = max_num_tokens
    return max_num_tokens, opt_num_tokens


def build(model, build_config: BuildConfig) -> Engine:
    tensorrt_llm.CALLS.append(("build", {"build_config": build_config, "model": model}))
    build_config = copy.deepcopy(build_config)
    cfg = model.config
    build_config.plugin_config.dtype = cfg.dtype
    build_config.update_kv_cache_type(cfg.architecture)
    if build_config.max_seq_len is None:
        build_config.max_seq_len = cfg.max_position_embeddings
    build_config.max_input_len = min(build_config.max_input_len, build_config.max_seq_len)
    pc = build_config.plugin_config
    build_config.max_num_tokens, build_config.opt_num_tokens = check_max_num_tokens(
        build_config.max_num_tokens, build_config.opt_num_tokens, build_config.max_batch_size,
        build_config.max_input_len, build_config.max_seq_len, build_config.max_beam_width,
        pc.remove_input_padding, pc.context_fmha, pc.tokens_per_block)
    plan = b"FAKEPLAN" + b"".join(
        w.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
        for _, w in sorted(model.weights.items()))
    if build_config.output_timing_cache is not None and cfg.mapping.rank == 0:
        with open(build_config.output_timing_cache, "wb") as f:   # relative: the cwd
            f.write(b"FAKE-TIMING-CACHE")
    return Engine(EngineConfig(cfg, build_config, tensorrt_llm.__version__), plan)
