"""Per-GPU engine build profiles: ``build/profiles/<gpu>.toml`` read into typed dataclasses.

A profile says which GPU it is for (device-name pattern, compute capability, memory) and how to
build and run the FP16 TensorRT-LLM engine on it. Users may edit the files; :func:`load_profile`
checks every key and says which one is wrong (file, key, what is expected) in one line.

Layout of a profile file::

    [gpu]      name_pattern, compute_capability ("8.6"), memory_gib
    [build]    dtype, gpt_attention_plugin, gemm_plugin, remove_input_padding, kv_cache_type,
               context_fmha, use_paged_context_fmha, max_batch_size, max_input_len,
               max_seq_len, max_num_tokens, max_beam_width
    [runtime]  kv_cache_free_gpu_memory_fraction, kv_cache_enable_block_reuse,
               enable_chunked_context
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from qwen_trt import settings
from qwen_trt.errors import QwenTrtError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PROFILES_DIR_ENV = "QWEN_TRT_PROFILES_DIR"
DTYPES = ("float16",)                      # this project builds FP16 engines only
PLUGIN_DTYPES = ("float16", "auto")        # "auto" = the model dtype (float16 here)
KV_CACHE_TYPES = ("paged",)                # in-flight batching (ModelRunnerCpp) needs paged KV
MAX_GPU_MEMORY_GIB = 4096                  # sanity bound: no single GPU comes near it
MAX_BATCH_SIZE = 2048                      # TensorRT-LLM's own examples stop at 2048
MAX_SEQ_LEN = 262144                       # Qwen3-4B-Instruct-2507's context length
MAX_NUM_TOKENS = 1 << 20


class ProfileError(QwenTrtError):
    """A build profile is missing or has a wrong key."""


@dataclass(frozen=True)
class GpuSpec:
    name_pattern: str            # regex, case-insensitive, searched in torch.cuda.get_device_name()
    compute_capability: str      # "8.6"
    memory_gib: float            # smallest memory of a card this profile is sized for

    @property
    def sm(self) -> str:
        return "sm" + self.compute_capability.replace(".", "")


@dataclass(frozen=True)
class BuildSpec:
    dtype: str
    gpt_attention_plugin: str
    gemm_plugin: str
    remove_input_padding: bool
    kv_cache_type: str
    context_fmha: bool
    use_paged_context_fmha: bool
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    max_beam_width: int = 1


@dataclass(frozen=True)
class RuntimeSpec:
    kv_cache_free_gpu_memory_fraction: float
    kv_cache_enable_block_reuse: bool = True
    enable_chunked_context: bool = True


@dataclass(frozen=True)
class BuildProfile:
    name: str                    # file stem: "a10"
    path: Path
    description: str
    gpu: GpuSpec
    build: BuildSpec
    runtime: RuntimeSpec

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "gpu": asdict(self.gpu),
                "build": asdict(self.build), "runtime": asdict(self.runtime)}


def default_profiles_dir() -> Path:
    """``$QWEN_TRT_PROFILES_DIR``, else ``build/profiles`` of the checkout, else of the cwd."""
    env = settings.get(PROFILES_DIR_ENV)
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2] / "build" / "profiles"
    return repo if repo.is_dir() else Path("build/profiles")


def available_profiles(profiles_dir: Path | None = None) -> list[str]:
    d = profiles_dir or default_profiles_dir()
    return sorted(p.stem for p in d.glob("*.toml") if p.is_file())


def _type_name(t) -> str:
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(t, str(t))


def _read_section(raw: dict, section: str, cls, where: str):
    """Build dataclass ``cls`` from ``raw[section]``, naming the bad key on any problem."""
    table = raw.get(section)
    if not isinstance(table, dict):
        raise ProfileError(f"{where}: missing table [{section}] (see build/profiles/a10.toml).")
    known = {f.name: f for f in fields(cls)}
    for key in table:
        if key not in known:
            raise ProfileError(f"{where}: unknown key [{section}].{key}; expected one of "
                               f"{', '.join(known)}.")
    values = {}
    for name, f in known.items():
        hint = {"str": str, "int": int, "float": float, "bool": bool}[str(f.type)]
        if name not in table:
            if f.default is not MISSING:          # optional key: the dataclass default applies
                continue
            raise ProfileError(f"{where}: missing key [{section}].{name} ({_type_name(hint)}).")
        value = table[name]
        ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
        if hint is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ProfileError(f"{where}: [{section}].{name} = {value!r} should be "
                               f"{_type_name(hint)}.")
        values[name] = value
    return cls(**values)


def _check(cond: bool, where: str, key: str, value, expected: str) -> None:
    if not cond:
        raise ProfileError(f"{where}: {key} = {value!r}; expected {expected}.")


def validate(profile: BuildProfile) -> None:
    """Range and consistency checks; raises :class:`ProfileError` naming the key."""
    w, g, b, r = str(profile.path), profile.gpu, profile.build, profile.runtime
    try:
        re.compile(g.name_pattern)
    except re.error as e:
        raise ProfileError(f"{w}: [gpu].name_pattern is not a valid regex: {e}") from e
    _check(re.fullmatch(r"\d+\.\d+", g.compute_capability) is not None, w,
           "[gpu].compute_capability", g.compute_capability, 'a string like "8.6"')
    _check(math.isfinite(g.memory_gib) and 0 < g.memory_gib <= MAX_GPU_MEMORY_GIB, w,
           "[gpu].memory_gib", g.memory_gib, f"a number of GiB from 0 to {MAX_GPU_MEMORY_GIB}")
    _check(b.dtype in DTYPES, w, "[build].dtype", b.dtype, " or ".join(DTYPES))
    for key in ("gpt_attention_plugin", "gemm_plugin"):
        _check(getattr(b, key) in PLUGIN_DTYPES, w, f"[build].{key}", getattr(b, key),
               " or ".join(PLUGIN_DTYPES))
    _check(b.remove_input_padding, w, "[build].remove_input_padding", b.remove_input_padding,
           "true (the C++ runtime's in-flight batching needs packed input)")
    _check(b.kv_cache_type in KV_CACHE_TYPES, w, "[build].kv_cache_type", b.kv_cache_type,
           '"paged" (the C++ runtime needs a paged KV cache)')
    for key, top in (("max_batch_size", MAX_BATCH_SIZE), ("max_input_len", MAX_SEQ_LEN),
                     ("max_seq_len", MAX_SEQ_LEN), ("max_num_tokens", MAX_NUM_TOKENS)):
        _check(1 <= getattr(b, key) <= top, w, f"[build].{key}", getattr(b, key),
               f"an integer from 1 to {top}")
    _check(b.max_beam_width == 1, w, "[build].max_beam_width", b.max_beam_width,
           "1 (chat streams one sequence)")
    _check(b.max_input_len < b.max_seq_len, w, "[build].max_input_len", b.max_input_len,
           f"less than max_seq_len ({b.max_seq_len}) so the reply has room")
    _check(b.max_num_tokens <= b.max_batch_size * b.max_seq_len, w, "[build].max_num_tokens",
           b.max_num_tokens, f"at most max_batch_size x max_seq_len "
           f"({b.max_batch_size * b.max_seq_len}); TensorRT-LLM would clip it")
    if not r.enable_chunked_context:
        _check(b.max_num_tokens >= b.max_input_len, w, "[build].max_num_tokens",
               b.max_num_tokens, f">= max_input_len ({b.max_input_len}) unless "
               "[runtime].enable_chunked_context = true")
    else:
        _check(b.use_paged_context_fmha and b.context_fmha, w, "[build].use_paged_context_fmha",
               b.use_paged_context_fmha,
               "true with context_fmha = true when [runtime].enable_chunked_context = true")
    if r.kv_cache_enable_block_reuse:
        _check(b.use_paged_context_fmha, w, "[build].use_paged_context_fmha",
               b.use_paged_context_fmha,
               "true when [runtime].kv_cache_enable_block_reuse = true")
    _check(0.05 <= r.kv_cache_free_gpu_memory_fraction <= 0.98, w,  # also false for nan
           "[runtime].kv_cache_free_gpu_memory_fraction", r.kv_cache_free_gpu_memory_fraction,
           "a fraction between 0.05 and 0.98")


def parse_profile(path: Path) -> BuildProfile:
    where = str(path)
    if path.is_dir():
        raise ProfileError(f"{where} is a folder, not a profile file: remove or rename it.")
    try:
        raw = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ProfileError(f"{where} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                           f"offset {e.start}): save it as UTF-8.") from e
    except OSError as e:
        raise ProfileError(f"{where} cannot be read: {e.strerror or e}.") from e
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{where} is not valid TOML: {e}") from e
    unknown = set(raw) - {"description", "gpu", "build", "runtime"}
    if unknown:
        raise ProfileError(f"{where}: unknown table or key {sorted(unknown)[0]!r}; expected "
                           "description, [gpu], [build], [runtime].")
    desc = raw.get("description", "")
    if not isinstance(desc, str):
        raise ProfileError(f"{where}: description should be a string.")
    profile = BuildProfile(
        name=path.stem, path=path, description=desc,
        gpu=_read_section(raw, "gpu", GpuSpec, where),
        build=_read_section(raw, "build", BuildSpec, where),
        runtime=_read_section(raw, "runtime", RuntimeSpec, where),
    )
    validate(profile)
    return profile


def load_profile(name: str, profiles_dir: Path | None = None) -> BuildProfile:
    """Load ``<profiles_dir>/<name>.toml`` (``name`` may also be a path to a .toml file)."""
    p = Path(name)
    if p.suffix == ".toml" and p.exists():
        return parse_profile(p)
    d = profiles_dir or default_profiles_dir()
    path = d / f"{name.lower()}.toml"
    if path.is_dir():
        return parse_profile(path)           # says it is a folder
    if not path.is_file():
        have = ", ".join(available_profiles(d)) or "none"
        raise ProfileError(f"No build profile '{name}' in {d} (have: {have}). Copy the closest "
                           f"one to {d}/{name.lower()}.toml and edit it.")
    return parse_profile(path)


def load_all(profiles_dir: Path | None = None) -> list[BuildProfile]:
    d = profiles_dir or default_profiles_dir()
    return [parse_profile(p) for p in sorted(d.glob("*.toml")) if p.is_file()]
