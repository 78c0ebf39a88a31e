"""``qwen-trt build``: HF checkpoint -> TensorRT-LLM checkpoint -> per-GPU engine folder (FP16;
BF16 with ``--dtype``; FP8 / INT4-AWQ / weight-only INT8/INT4 with ``--quant``, see
:mod:`qwen_trt.engine.quant`).

Stages (each prints one line with its timing; export and build are skipped when the hash of
their inputs matches the stamp of their last run, ``force`` reruns them):

1. resolve  the checkpoint (folder or hub id) and check it is Qwen3 with consistent shapes
2. export   ``QWenForCausalLM.from_hugging_face(dir, dtype="float16", mapping=Mapping(...))``
            then ``save_checkpoint(build/out/<gpu>/checkpoint, save_config=True)``
3. build    ``tensorrt_llm.build(QWenForCausalLM.from_checkpoint(ckpt), BuildConfig(...))``
            then ``engine.save(engines/<gpu>/)``, tokenizer files, ``manifest.json``
4. verify   the engine's ``config.json`` has the limits and plugins the profile asked for

TensorRT-LLM calls were checked against NVIDIA/TensorRT-LLM sources (stored snapshots; the
search index does not say which tag each commit is, so the commit is recorded):

* ``QWenForCausalLM.from_hugging_face(hf_model_or_dir, dtype='auto', mapping=None,
  quant_config=None, **kwargs)``: tensorrt_llm/models/qwen/model.py @04a2cacb.
* ``PretrainedModel.save_checkpoint(output_dir, save_config=True)`` (writes
  ``rank{N}.safetensors`` + ``config.json`` into an existing folder; it does not create it) and
  ``from_checkpoint(ckpt_dir, rank=None, config=None, *, preprocess_weights_hook=None)``:
  tensorrt_llm/models/modeling_utils.py (stored snapshot, index commit 27712aa7); the flow of
  examples/models/core/qwen/convert_checkpoint.py @65b31db1 and tensorrt_llm/commands/build.py
  @008b2b8d (``build_and_save`` -> ``engine.save(output_dir)``).
* ``BuildConfig(max_input_len, max_seq_len, max_batch_size, max_beam_width, max_num_tokens,
  kv_cache_type: KVCacheType, plugin_config: PluginConfig, ...)`` and ``Engine.save``:
  tensorrt_llm/builder.py @008b2b8d; ``KVCacheType`` from ``tensorrt_llm.bindings`` (the same
  import in builder.py and runtime/model_runner_cpp.py @03832911).
* ``PluginConfig`` fields ``gpt_attention_plugin``, ``gemm_plugin``, ``remove_input_padding``,
  ``context_fmha``, ``use_paged_context_fmha``: tensorrt_llm/plugin/plugin.py @035b99e0 (a
  dataclass there, a pydantic model in 1.x; both take attribute assignment).
* ``Mapping(world_size, rank, tp_size, pp_size)``: tensorrt_llm/mapping.py, imported as
  ``tensorrt_llm.mapping.Mapping`` by runtime/model_runner_cpp.py @03832911.
"""
from __future__ import annotations

import gc
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qwen_trt import settings
from qwen_trt.engine.profiles import BuildProfile, load_all, load_profile
from qwen_trt.engine.env import library_versions, require_disk, require_trtllm
from qwen_trt.engine.manifest import (TOKENIZER_DIR, TOKENIZER_FILES, Stamp, checkpoint_files,
                                      content_hash, fingerprint, hub_revision, make_manifest,
                                      write_manifest)
from qwen_trt.errors import first_line, ModelSourceError, QwenTrtError
from qwen_trt.engine.gpu import check_profile_matches, require_gpu
from qwen_trt.engine.quant import (QuantSpec, check_gpu, engine_weight_bytes, get_quant,
                                   quant_config)
from qwen_trt.model.shape import ModelShape
from qwen_trt.model.source import ModelSource, load_tokenizer, resolve_model
from qwen_trt.progress import StageLog

ENGINE_FILES = ("config.json", "rank0.engine")
CHECKPOINT_FILES = ("config.json", "rank0.safetensors")
GB = 10**9


class BuildError(QwenTrtError):
    """TensorRT-LLM failed to export or build, or built something other than asked for."""


# ---------------------------------------------------------------- model checks (pure)

def check_model_shapes(config: dict, where: str = "config.json") -> ModelShape:
    """The Qwen3 shape facts the TensorRT-LLM converter relies on (:class:`ModelShape`, whose
    docstring gives the one head_dim policy).

    Qwen3-4B has head_dim 128 while hidden/heads = 2560/32 = 80; converters that derive the
    head size from hidden/heads build wrong-shaped QKV weights (NVIDIA/TensorRT-LLM#5912), so a
    Qwen3-4B-sized config must say head_dim 128.
    """
    shape = ModelShape.from_config(config, where)
    if shape.hidden == 2560 and shape.layers == 36 and shape.head_dim != 128:  # Qwen3-4B
        how = "" if config.get("head_dim") else " (head_dim missing: hidden/heads)"
        raise ModelSourceError(f"{where}: a Qwen3-4B config (36 layers, hidden 2560) with head_dim "
                               f"{shape.head_dim}{how}; the real model has head_dim 128.")
    return shape


def hf_rope_theta(config: dict) -> float | None:
    """RoPE base from an HF config: ``rope_theta`` (transformers 4.x layout) or
    ``rope_parameters.rope_theta`` (the layout transformers 5 writes)."""
    if "rope_theta" in config:
        return float(config["rope_theta"])
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    return float(theta) if theta is not None else None


def needs_legacy_config(config: dict) -> bool:
    """True when config.json has the transformers-5 layout (``rope_parameters``, ``dtype``).

    TensorRT-LLM's QWenConfig.from_hugging_face reads ``getattr(hf_config, "rope_theta",
    100000.0)`` and ``infer_dtype(dtype, getattr(hf_config, 'torch_dtype', None))``
    (tensorrt_llm/models/qwen/config.py:135 and :152 @0428c188); with the new layout under the
    transformers it pins (4.57), the RoPE base silently becomes a default.
    """
    return "rope_theta" not in config and hf_rope_theta(config) is not None


def converter_config(config: dict, shape: ModelShape) -> dict:
    """The HF config as TensorRT-LLM's Qwen converter must read it, on every 1.x version.

    * ``kv_channels`` = ``head_dim``. The converter's head size is ``getattr(hf_config,
      "kv_channels", head_dim)`` on every version; what differs is ``head_dim``: later mains read
      ``getattr(hf_config, "head_dim", hidden // heads)`` (tensorrt_llm/models/qwen/config.py:
      112-115 @0428c188, :118-121 @373970a8), the first Qwen3 engine support (PR #5650, 1.0.0rc3)
      computed ``hidden // heads`` -- 80 for Qwen3-4B instead of 128, failing with "Updated:
      (6144, 2560), original: (3840, 2560)" (issue #5912; the fix PR #5913 was closed, and which
      tags carry the later form is not confirmed). ``kv_channels`` is honoured by both.
    * ``rope_theta`` / ``torch_dtype`` when the checkpoint has the transformers-5 layout
      (:func:`needs_legacy_config`).
    """
    cfg = dict(config)
    cfg["kv_channels"] = shape.head_dim
    if needs_legacy_config(config):
        cfg["rope_theta"] = hf_rope_theta(cfg)
    if "torch_dtype" not in cfg and "dtype" in cfg:
        cfg["torch_dtype"] = cfg["dtype"]
    return cfg


def stage_checkpoint(source: ModelSource, dest: Path, shape: ModelShape) -> Path:
    """A folder of symlinks to ``source`` whose config.json is :func:`converter_config`."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in source.path.iterdir():
        if f.name != "config.json":
            (dest / f.name).symlink_to(f.resolve())
    (dest / "config.json").write_text(json.dumps(converter_config(source.config, shape), indent=2))
    return dest


def check_converter_config(cfg, shape: ModelShape, where: str) -> None:
    """The head size and head counts TensorRT-LLM derived, checked *before* it loads weights
    (``QWenForCausalLM.config_class.from_hugging_face`` reads only config.json)."""
    problems = []
    for attr, want in (("head_size", shape.head_dim), ("num_attention_heads", shape.heads),
                       ("num_key_value_heads", shape.kv_heads), ("hidden_size", shape.hidden)):
        have = getattr(cfg, attr, None)
        if have is not None and int(have) != want:
            problems.append(f"{attr} {have} (checkpoint: {want})")
    if problems:
        raise BuildError(
            f"TensorRT-LLM's converter read {where} as {'; '.join(problems)}: this tensorrt_llm "
            f"derives the head size differently (Qwen3 needs head_dim from config.json, "
            f"NVIDIA/TensorRT-LLM#5912); install tensorrt_llm 1.2.x (see docs/tensorrt-llm.md).")


def verify_checkpoint_config(ckpt_dir: Path, shape: ModelShape, hf_config: dict,
                             dtype: str = "float16", quant: QuantSpec | None = None) -> None:
    """The exported TensorRT-LLM checkpoint must carry the HF shapes and RoPE base."""
    path = ckpt_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BuildError(f"{path} is missing or unreadable after export ({e}).") from e
    problems = []
    for key, want in (("head_size", shape.head_dim), ("num_key_value_heads", shape.kv_heads),
                      ("num_attention_heads", shape.heads), ("hidden_size", shape.hidden),
                      ("num_hidden_layers", shape.layers), ("vocab_size", shape.vocab)):
        if key in cfg and int(cfg[key]) != want:
            problems.append(f"{key} {cfg[key]} (checkpoint: {want})")
    theta = hf_rope_theta(hf_config)
    if theta is not None and "rotary_base" in cfg and abs(float(cfg["rotary_base"]) - theta) > 1e-3 * theta:
        problems.append(f"rotary_base {cfg['rotary_base']} (checkpoint rope_theta: {theta:g})")
    if cfg.get("dtype") not in (None, dtype):
        problems.append(f"dtype {cfg['dtype']} (asked {dtype})")
    algo = quant_algo_of(cfg)
    want_algo = quant.quant_algo if quant else None
    if algo != want_algo:
        problems.append(f"quantization {algo} (asked {want_algo})")
    if problems:
        raise BuildError(
            f"TensorRT-LLM's converter wrote {path} with {'; '.join(problems)}: it read the HF "
            f"config differently; install the transformers version your tensorrt_llm pins "
            f"(4.57.x for 1.2) and rebuild with --force.")


def quant_algo_of(pretrained_config: dict) -> str | None:
    """The ``quantization.quant_algo`` a TensorRT-LLM checkpoint / engine config records, as the
    QuantAlgo member name (None: unquantized)."""
    q = pretrained_config.get("quantization") or {}
    algo = q.get("quant_algo") if isinstance(q, dict) else None
    return str(algo).split(".")[-1] if algo else None


# ---------------------------------------------------------------- profile -> TensorRT-LLM (pure)

BUILD_DTYPES = ("float16", "bfloat16")
BF16_MIN_CC = (8, 0)            # bfloat16 tensor cores: Ampere (sm80) and newer
TIMING_CACHE = "model.cache"


def resolve_dtype(requested: str | None, profile: BuildProfile, gpu) -> str:
    """The engine dtype: the profile's (float16, as the model card asks) unless overridden.

    bfloat16 is offered for GPUs with bf16 tensor cores (compute capability 8.0+); Qwen3 was
    trained in bf16, and an fp16 engine can overflow (docs/tensorrt-llm.md, "FP16 or BF16").
    """
    dtype = requested or profile.build.dtype
    if dtype not in BUILD_DTYPES:
        raise BuildError(f"--dtype {dtype}: expected one of {', '.join(BUILD_DTYPES)}.")
    if dtype == "bfloat16" and tuple(gpu.compute_capability) < BF16_MIN_CC:
        raise BuildError(f"--dtype bfloat16 needs an Ampere or newer GPU (sm80+); this GPU is "
                         f"{gpu.short_name} ({gpu.sm}): build float16 instead.")
    return dtype


def engine_folder_name(profile: BuildProfile, dtype: str, quant: QuantSpec | None = None) -> str:
    """``<profile>`` for the default float16 engine, ``<profile>-bf16`` for bfloat16, and
    ``-<quant>`` after either for a quantized one (``a10-int4_awq``), so the engines of one GPU
    live side by side under engines/."""
    name = profile.name if dtype == "float16" else f"{profile.name}-bf16"
    return f"{name}-{quant.name}" if quant else name


def plugin_settings(profile: BuildProfile, dtype: str | None = None) -> dict:
    """PluginConfig attributes to set (names as in tensorrt_llm/plugin/plugin.py).

    The profile's plugin dtypes ("float16" or "auto") follow the engine dtype, so a bfloat16
    override builds bf16 plugins too (as the BF16 recipe of TensorRT-LLM's Qwen README does:
    examples/models/core/qwen/README.md).
    """
    b = profile.build
    dtype = dtype or b.dtype

    def plugin(value: str) -> str:
        return value if value == "auto" or dtype == b.dtype else dtype

    return {
        "gpt_attention_plugin": plugin(b.gpt_attention_plugin),
        "gemm_plugin": plugin(b.gemm_plugin),
        "remove_input_padding": b.remove_input_padding,
        "context_fmha": b.context_fmha,
        "use_paged_context_fmha": b.use_paged_context_fmha,
    }


def build_config_kwargs(profile: BuildProfile) -> dict:
    """BuildConfig keyword arguments, max_seq_len always explicit (the model default is 262144).

    ``kv_cache_type`` is the profile's string; :func:`make_build_config` turns it into the
    ``tensorrt_llm.bindings.KVCacheType`` enum.
    """
    b = profile.build
    return {
        "max_batch_size": b.max_batch_size,
        "max_input_len": b.max_input_len,
        "max_seq_len": b.max_seq_len,
        "max_num_tokens": b.max_num_tokens,
        "max_beam_width": b.max_beam_width,
        "kv_cache_type": b.kv_cache_type,
    }


def build_flags(profile: BuildProfile, dtype: str | None = None,
                quant: QuantSpec | None = None) -> dict:
    """Everything that decides the engine, as recorded in the manifest and the build stamp."""
    dtype = dtype or profile.build.dtype
    flags = {"dtype": dtype, "build_config": build_config_kwargs(profile),
             "plugin_config": plugin_settings(profile, dtype)}
    if quant is not None:
        flags["quantization"] = quant.to_manifest()
    return flags


def _builder_api():
    """``(BuildConfig, build)`` from ``tensorrt_llm.builder``, where builder.py @008b2b8d defines
    them; the 1.x top level re-exports the same objects (main after 1.3 no longer does)."""
    try:
        from tensorrt_llm.builder import BuildConfig, build
    except ImportError:  # pragma: no cover - layout variant
        from tensorrt_llm import BuildConfig, build
    return BuildConfig, build


def make_build_config(profile: BuildProfile, dtype: str | None = None,
                      timing_cache: Path | None = None):
    """A real ``tensorrt_llm.BuildConfig`` for ``profile`` (needs tensorrt_llm).

    ``BuildConfig.output_timing_cache`` defaults to ``'model.cache'`` and ``build()`` writes it
    to that path after building (tensorrt_llm/builder.py @008b2b8d: the BuildConfig field and
    ``if build_config.output_timing_cache is not None and ... rank == 0:
    builder.save_timing_cache(...)`` at the end of ``build``), i.e. into whatever the current
    directory is. So the cache goes to ``timing_cache`` in the build work folder, and a cache
    left there by an earlier build is read back (``input_timing_cache``) to speed up rebuilds.
    """
    BuildConfig, _ = _builder_api()
    from tensorrt_llm.bindings import KVCacheType
    from tensorrt_llm.plugin import PluginConfig

    plugin = PluginConfig()
    for name, value in plugin_settings(profile, dtype).items():
        setattr(plugin, name, value)
    kwargs = build_config_kwargs(profile)
    kwargs["kv_cache_type"] = {"paged": KVCacheType.PAGED}[kwargs["kv_cache_type"]]
    if timing_cache is not None:
        kwargs["output_timing_cache"] = str(timing_cache)
        kwargs["input_timing_cache"] = str(timing_cache) if timing_cache.is_file() else None
    return BuildConfig(plugin_config=plugin, **kwargs)


def verify_engine_config(engine_dir: Path, profile: BuildProfile, shape: ModelShape,
                         dtype: str | None = None, quant: QuantSpec | None = None) -> None:
    """Check the ``config.json`` TensorRT-LLM wrote against what we asked for."""
    path = engine_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
        bc, pc = cfg["build_config"], cfg["build_config"]["plugin_config"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise BuildError(f"{path} is missing or has no build_config ({e}).") from e
    problems = []
    for key, want in build_config_kwargs(profile).items():
        have = bc.get(key)
        if key == "kv_cache_type":
            have, want = str(have).split(".")[-1].lower(), want
        if have != want:
            problems.append(f"build_config.{key} = {have!r}, asked {want!r}")
    for key in ("remove_input_padding", "context_fmha"):
        if key in pc and bool(pc[key]) != getattr(profile.build, key):
            problems.append(f"plugin_config.{key} = {pc[key]!r}")
    if not pc.get("gpt_attention_plugin"):
        problems.append("plugin_config.gpt_attention_plugin is off")
    dtype = dtype or profile.build.dtype
    built = (cfg.get("pretrained_config") or {}).get("dtype")
    if built is not None and built != dtype:
        problems.append(f"pretrained_config.dtype = {built!r}, asked {dtype!r}")
    algo = quant_algo_of(cfg.get("pretrained_config") or {})
    if algo != (quant.quant_algo if quant else None):
        problems.append(f"pretrained_config.quantization.quant_algo = {algo!r}, asked "
                        f"{quant.quant_algo if quant else None!r}")
    head = (cfg.get("pretrained_config") or {}).get("head_size")
    if head is not None and int(head) != shape.head_dim:
        problems.append(f"pretrained_config.head_size = {head}, the checkpoint's head_dim is "
                        f"{shape.head_dim}")
    if problems:
        raise BuildError(f"The engine in {engine_dir} is not what profile {profile.name} asked "
                         f"for: {'; '.join(problems)}.")


# ---------------------------------------------------------------- pipeline

@dataclass
class BuildRequest:
    gpu: str                                   # profile name: "a10"
    model: str | None = None                   # folder or hub id
    out_dir: Path = Path("build/out")
    engines_dir: Path = Path("engines")
    profiles_dir: Path | None = None
    force: bool = False
    dtype: str | None = None                   # None: the profile's (float16); or "bfloat16"
    quant: str | None = None                   # None: unquantized; else a key of engine.quant.QUANTS


@dataclass
class BuildResult:
    engine_dir: Path
    manifest: dict
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _weights_bytes(source: ModelSource) -> int:
    return sum(f.stat().st_size for f in checkpoint_files(source.path))


def param_count(source: ModelSource) -> int:
    """Parameters stored in the checkpoint's safetensors files (from their headers only)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(source.path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                count = 1
                for d in st.get_slice(key).get_shape():
                    count *= int(d)
                n += count
    return n


def engine_weights(shape: ModelShape, params: int, dtype: str,
                   quant: QuantSpec | None = None) -> dict:
    """What the engine stores for the weights, for the manifest and the profiles' sizing.

    Qwen3-4B ties ``lm_head`` to ``embed_tokens`` and its checkpoint has no ``lm_head.weight``.
    The converter reads ``tie_word_embeddings`` into its config (tensorrt_llm/models/qwen/
    config.py:153 @0428c188) but gives the model a ``lm_head`` parameter of its own and fills it
    from ``model.embed_tokens`` (the qwen3 branch of QWenForCausalLM.from_hugging_face maps no
    lm_head key; ``ModelWeightsLoader.update_key_mapping`` points a missing ``lm_head`` at
    ``transformer.vocab_embedding``'s HF key, tensorrt_llm/models/model_weights_loader.py
    @7eb710fa), so the engine holds the embedding twice: +vocab x hidden x 2 bytes (0.78 GB for
    Qwen3-4B). A quantized engine stores its linear layers at the quantized width and the
    embedding and lm_head at 16 bits (:func:`qwen_trt.engine.quant.engine_weight_bytes`). Not
    measured here; ``engine_file_bytes`` in the manifest is the real size.
    """
    embed = shape.vocab * shape.hidden
    return {"dtype": dtype, "checkpoint_params": params, "tied_embeddings": shape.tied_embeddings,
            "lm_head_stored_separately": shape.tied_embeddings,
            "quantization": quant.name if quant else None,
            "estimated_bytes": engine_weight_bytes(params, embed, shape.tied_embeddings, quant)}


def _tokenizer_info(source: ModelSource) -> dict:
    from qwen_trt.model.template import default_stop_ids, end_and_pad_ids

    tok = load_tokenizer(source.path, source.name)
    end_id, pad_id = end_and_pad_ids(tok)
    return {"end_id": end_id, "pad_id": pad_id, "stop_ids": list(default_stop_ids(tok)),
            "files": []}


def _copy_tokenizer(source: ModelSource, dest: Path) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        f = source.path / name
        if f.is_file():
            shutil.copy2(f, dest / name)
            copied.append(name)
    return copied


def export_checkpoint(source: ModelSource, ckpt_dir: Path, shape: ModelShape,
                      dtype: str = "float16", quant: QuantSpec | None = None) -> None:
    """HF folder -> TensorRT-LLM checkpoint (config.json + rank0.safetensors), verified.

    Unquantized and weight-only INT8/INT4: ``from_hugging_face(..., quant_config=...)`` then
    ``save_checkpoint``. FP8 and INT4-AWQ: ``quantize(...)`` with ModelOpt's calibration set,
    which writes the checkpoint itself (see :mod:`qwen_trt.engine.quant`).

    The converter reads a staged copy of the checkpoint (:func:`stage_checkpoint`: the same
    weights, config.json with ``kv_channels``), and its head size is checked from the config
    alone before any weight is loaded (:func:`check_converter_config`).
    """
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models import MODEL_MAP

    archs = source.config.get("architectures") or ["Qwen3ForCausalLM"]
    model_cls = MODEL_MAP.get(archs[0])
    if model_cls is None:
        raise BuildError(f"This tensorrt_llm has no TensorRT engine support for {archs[0]} "
                         f"(Qwen3 needs tensorrt_llm>=1.0).")
    if ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    ckpt_dir.mkdir(parents=True)   # save_checkpoint writes into it but does not create it
    mapping = Mapping(world_size=1, rank=0, tp_size=1, pp_size=1)
    hf_dir = stage_checkpoint(source, ckpt_dir.parent / "hf-staging", shape)
    model = None
    try:
        qc = quant_config(quant) if quant else None
        config_cls = getattr(model_cls, "config_class", None)   # QWenConfig (qwen/model.py)
        if config_cls is not None:
            cfg = config_cls.from_hugging_face(str(hf_dir), dtype=dtype, mapping=mapping,
                                               quant_config=qc)
            check_converter_config(cfg, shape, f"{source.name}'s config.json")
        if quant is not None and quant.modelopt:
            cal = quant.calibration()
            model_cls.quantize(str(hf_dir), str(ckpt_dir), dtype=dtype, mapping=mapping,
                               quant_config=qc, calib_dataset=cal.dataset,
                               calib_batches=cal.batches, calib_max_seq_length=cal.max_seq_length)
        else:
            model = model_cls.from_hugging_face(str(hf_dir), dtype=dtype, mapping=mapping,
                                                quant_config=qc)
            model.save_checkpoint(str(ckpt_dir), save_config=True)
    except QwenTrtError:
        raise
    except Exception as e:  # converter assertion, shape mismatch, OOM...
        first = first_line(e)
        what = f"quantize ({quant.name}) " if quant is not None and quant.modelopt else "convert "
        raise BuildError(f"TensorRT-LLM could not {what}{source.name} ({type(e).__name__}: "
                         f"{first}); the full log is above.") from e
    finally:
        model = None
        gc.collect()
    verify_checkpoint_config(ckpt_dir, shape, source.config, dtype, quant)


def build_engine(ckpt_dir: Path, profile: BuildProfile, engine_dir: Path,
                 dtype: str | None = None, timing_cache: Path | None = None) -> None:
    """TensorRT-LLM checkpoint -> engine folder (config.json + rank0.engine)."""
    from tensorrt_llm.models import MODEL_MAP

    _, trt_build = _builder_api()
    arch = json.loads((ckpt_dir / "config.json").read_text()).get("architecture",
                                                                  "Qwen3ForCausalLM")
    model_cls = MODEL_MAP[arch]
    model = engine = None
    try:
        model = model_cls.from_checkpoint(str(ckpt_dir))
        engine = trt_build(model, make_build_config(profile, dtype, timing_cache))
        engine.save(str(engine_dir))
    except QwenTrtError:
        raise
    except Exception as e:
        first = first_line(e)
        raise BuildError(f"TensorRT-LLM failed to build the engine ({type(e).__name__}: {first}); "
                         f"the full log is above.") from e
    finally:
        model = engine = None
        gc.collect()


IMAGE_ENV = "QWEN_TRT_IMAGE"    # set by docker/Dockerfile to the image it is built FROM


def container_image() -> str | None:
    """The container image this build runs in (docker/Dockerfile sets ``QWEN_TRT_IMAGE``):
    the image fixes the TensorRT version an engine can load on, so the manifest records it."""
    
    return settings.get(IMAGE_ENV)


def run_build(req: BuildRequest, write: Callable[[str], None] | None = None) -> BuildResult:
    """Run the guarded pipeline; raises a :class:`QwenTrtError` subclass on any user problem."""
    profile = load_profile(req.gpu, req.profiles_dir)
    trtllm = require_trtllm()
    gpu = require_gpu()
    try:
        others = load_all(profile.path.parent)
    except QwenTrtError:   # a broken sibling profile must not block this build
        others = [profile]
    check_profile_matches(gpu, profile, others)
    dtype = resolve_dtype(req.dtype, profile, gpu)
    quant = get_quant(req.quant)
    check_gpu(quant, gpu, f"QUANT={quant.name}" if quant else "")   # before any stage runs
    log = StageLog(4, write)
    what = f"{dtype}, {quant.name}" if quant else dtype
    log.line(f"qwen-trt build: profile {profile.name} ({what}) on {gpu.describe()}, "
             f"tensorrt_llm {trtllm.__version__}")

    source: ModelSource = log.run("resolve", f"model {req.model or '(default)'}",
                                  lambda: resolve_model(req.model))
    shape = check_model_shapes(source.config, f"'{source.name}'/config.json")
    versions = library_versions()

    name = engine_folder_name(profile, dtype, quant)
    out = Path(req.out_dir) / name
    ckpt_dir = out / "checkpoint"
    timing_cache = out / TIMING_CACHE    # not the cwd (BuildConfig's default 'model.cache')
    engine_dir = Path(req.engines_dir) / name
    export_stamp = Stamp("export", {
        "checkpoint": fingerprint(source.path, checkpoint_files(source.path)),
        "dtype": dtype, "tensorrt_llm": versions["tensorrt_llm"],
        "quantization": quant.to_manifest() if quant else None,
        "converter_config": converter_config(source.config, shape)})
    tok_files = [source.path / n for n in TOKENIZER_FILES if (source.path / n).is_file()]
    build_stamp = Stamp("build", {
        "export": export_stamp.digest, "flags": build_flags(profile, dtype, quant),
        "versions": {k: versions[k] for k in ("tensorrt_llm", "tensorrt")},
        "gpu": {"name": gpu.name, "cc": gpu.cc},
        "tokenizer": fingerprint(source.path, tok_files)})

    skip_export = not req.force and export_stamp.is_current(ckpt_dir, CHECKPOINT_FILES)
    skip_build = (not req.force and skip_export
                  and build_stamp.is_current(engine_dir, ENGINE_FILES + ("manifest.json",)))
    weights = _weights_bytes(source)
    if not skip_export:
        require_disk(out, int(weights * 1.1) + GB, "the TensorRT-LLM checkpoint")
    if not skip_build:
        require_disk(Path(req.engines_dir), int(weights * 1.2) + GB, "the engine")

    def do_export() -> None:
        export_checkpoint(source, ckpt_dir, shape, dtype, quant)
        export_stamp.write(ckpt_dir)

    log.run("export", f"-> {ckpt_dir}", do_export, skip=skip_export)
    tmp = engine_dir.with_name(f".{engine_dir.name}.building")

    def do_build() -> None:
        if tmp.exists():
            shutil.rmtree(tmp)
        build_engine(ckpt_dir, profile, tmp, dtype, timing_cache)

    log.run("build", f"-> {engine_dir}", do_build, skip=skip_build)
    if skip_build:
        from qwen_trt.engine.manifest import read_manifest

        manifest = read_manifest(engine_dir)
        runtime = profile.to_dict()["runtime"]
        if manifest["runtime"] != runtime:   # run-time settings need no new engine
            manifest["runtime"], manifest["profile"] = runtime, profile.to_dict()
            write_manifest(engine_dir, manifest)
            log.line(f"updated the runtime settings in {engine_dir / 'manifest.json'}")
        log.line(f"engine up to date: {engine_dir}")
        return BuildResult(engine_dir, manifest, ran=["resolve"],
                           skipped=["export", "build", "verify"])

    def do_verify() -> dict:
        verify_engine_config(tmp, profile, shape, dtype, quant)
        tok = _tokenizer_info(source)
        tok["files"] = _copy_tokenizer(source, tmp / TOKENIZER_DIR)
        model_info = {
            "source": source.name, "path": str(source.path), "revision": hub_revision(source.path),
            "checkpoint_sha256": content_hash(checkpoint_files(source.path), source.path),
            "shape": shape.__dict__}
        weights_info = engine_weights(shape, param_count(source), dtype, quant)
        weights_info["engine_file_bytes"] = (tmp / "rank0.engine").stat().st_size
        timings = dict(log.timings)
        timings["total"] = round(sum(timings.values()), 3)   # up to the manifest itself
        manifest = make_manifest(gpu=gpu, profile=profile, versions=versions, model=model_info,
                                 build_flags=build_flags(profile, dtype, quant), timings_s=timings,
                                 stamp_digest=build_stamp.digest, tokenizer=tok,
                                 weights=weights_info, container=container_image())
        write_manifest(tmp, manifest)
        build_stamp.write(tmp)
        if engine_dir.exists():
            shutil.rmtree(engine_dir)
        tmp.rename(engine_dir)
        return manifest

    manifest = log.run("verify", "engine config, tokenizer, manifest.json", do_verify)
    log.line(f"engine ready: {engine_dir} (chat: `qwen-trt chat --backend trtllm --engine {engine_dir}`)")
    ran = ["resolve"] + [s for s, sk in (("export", skip_export), ("build", False)) if not sk]
    return BuildResult(engine_dir, manifest, ran=ran + ["verify"],
                       skipped=["export"] if skip_export else [])
