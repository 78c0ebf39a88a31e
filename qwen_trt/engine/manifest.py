"""Our sidecar for an engine folder: ``manifest.json``.

TensorRT-LLM 1.x writes ``config.json`` (``{"version", "pretrained_config", "build_config"}``,
read in NVIDIA/TensorRT-LLM ``tensorrt_llm/builder.py`` ``EngineConfig.to_dict`` /
``Engine.save``, stored commit 008b2b8d) but records no GPU name and no TensorRT version. An engine
only deserializes on the compute capability and TensorRT version it was built with, and a wrong
one fails deep inside TensorRT ("The engine plan file is generated on an incompatible device").
So every engine folder built here carries a manifest, and :func:`check_manifest` compares it with
this machine *before* TensorRT sees the plan.

Stage stamps live here too: a stage is skipped when the hash of its inputs equals the stamp its
last successful run left behind.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from qwen_trt.errors import EngineMismatchError, QwenTrtError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")


class ManifestError(QwenTrtError):
    """An engine folder has no (or an unreadable) manifest."""


# ---------------------------------------------------------------- hashing and stamps

def hash_json(obj) -> str:
    """sha256 of a canonical JSON dump (sorted keys)."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(data).hexdigest()


def checkpoint_files(folder: Path) -> list[Path]:
    """The files of an HF checkpoint that decide the engine: config and weights."""
    files = [folder / "config.json"]
    files += sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    files += sorted(folder.glob("*.safetensors.index.json"))
    return [f for f in files if f.is_file()]


def fingerprint(folder: Path, files: list[Path] | None = None) -> str:
    """Cheap identity of a folder's files: relative name, size, mtime (for stage stamps)."""
    items = []
    for f in files if files is not None else sorted(p for p in folder.rglob("*") if p.is_file()):
        st = f.stat()
        items.append([str(f.relative_to(folder)), st.st_size, st.st_mtime_ns])
    return hash_json(items)


def content_hash(files: list[Path], root: Path, chunk: int = 8 << 20) -> str:
    """sha256 over the names and full contents of ``files`` (for the manifest)."""
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(chunk):
                h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Stamp:
    """A stage's input hash, stored as ``<dir>/.stamp-<stage>.json``."""

    stage: str
    inputs: dict

    @property
    def digest(self) -> str:
        return hash_json({"stage": self.stage, "inputs": self.inputs})

    def path(self, folder: Path) -> Path:
        return folder / f".stamp-{self.stage}.json"

    def is_current(self, folder: Path, outputs: tuple[str, ...] = ()) -> bool:
        """True when the stamp in ``folder`` matches and every output file exists."""
        p = self.path(folder)
        if not p.is_file() or any(not (folder / o).exists() for o in outputs):
            return False
        try:
            return json.loads(p.read_text()).get("digest") == self.digest
        except (OSError, json.JSONDecodeError):
            return False

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path(folder).write_text(json.dumps(
            {"stage": self.stage, "digest": self.digest, "inputs": self.inputs,
             "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            indent=2, sort_keys=True, default=str))


# ---------------------------------------------------------------- manifest

def hub_revision(path: Path) -> str | None:
    """The commit of a huggingface_hub cache snapshot (``.../snapshots/<sha>/``), else None."""
    if path.parent.name == "snapshots" and len(path.name) == 40:
        return path.name
    return None


def make_manifest(*, gpu, profile, versions: dict, model: dict, build_flags: dict,
                  timings_s: dict, stamp_digest: str, tokenizer: dict,
                  weights: dict | None = None, container: str | None = None) -> dict:
    """The manifest dict written next to ``rank0.engine``.

    ``dtype`` is the engine's (float16 by default, bfloat16 when built with ``--dtype``);
    ``quantization`` what ``--quant`` asked (:meth:`qwen_trt.engine.quant.QuantSpec.to_manifest`:
    name, QuantAlgo, calibration set), None for an unquantized engine;
    ``weights`` what the engine stores (tied embeddings are stored twice, see
    :func:`qwen_trt.engine.build.engine_weights`); ``container`` the image it was built in.
    """
    return {
        "format": MANIFEST_FORMAT,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu": {"name": gpu.name, "compute_capability": gpu.cc,
                "memory_gib": round(gpu.memory_gib, 2)},
        "versions": versions,
        "profile": profile.to_dict(),
        "model": model,
        "build_flags": build_flags,
        "dtype": build_flags.get("dtype", profile.build.dtype),
        "quantization": build_flags.get("quantization"),   # None: unquantized
        "weights": weights or {},
        "container": {"image": container} if container else None,
        "limits": {k: getattr(profile.build, k) for k in
                   ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                    "max_beam_width")},
        "runtime": dict(profile.to_dict()["runtime"]),
        "tokenizer": tokenizer,
        "timings_s": timings_s,
        "stamp": stamp_digest,
    }


def write_manifest(engine_dir: Path, manifest: dict) -> Path:
    p = engine_dir / MANIFEST_NAME
    p.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
    return p


def read_manifest(engine_dir: Path) -> dict:
    p = Path(engine_dir) / MANIFEST_NAME
    if not p.is_file():
        raise ManifestError(
            f"{engine_dir} has no {MANIFEST_NAME}: it was not built by `qwen-trt build`. "
            f"Build one with `make engine GPU=<gpu>` (profiles in build/profiles/).")
    try:
        m = json.loads(p.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{p} is unreadable ({e}); rebuild with `make engine GPU=<gpu>`.") from e
    problem = manifest_shape_problem(m)
    if problem:
        raise ManifestError(f"{p}: {problem}; rebuild with `make engine GPU=<gpu>`.")
    return m


_LIMIT_KEYS = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens")


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false",
            type(None): "null"}.get(type(value), "a number")


def manifest_shape_problem(m) -> str | None:
    """What is wrong with the structure of a manifest (None when it has what the runtime
    reads, with the right types)."""
    if not isinstance(m, dict):
        return f"holds {_kind(m)}, not a JSON object"
    for key in ("gpu", "versions", "profile", "limits", "runtime"):
        if key not in m:
            return f"lacks '{key}'"
        if not isinstance(m[key], dict):
            return f"'{key}' is {m[key]!r} ({_kind(m[key])}); expected an object"
    for key in ("model", "tokenizer", "build_flags"):
        if m.get(key) is not None and not isinstance(m[key], dict):
            return f"'{key}' is {m[key]!r} ({_kind(m[key])}); expected an object"
    gpu = m["gpu"]
    for key in ("name", "compute_capability"):
        if not isinstance(gpu.get(key), str):
            return f"'gpu.{key}' is {gpu.get(key)!r}; expected a string"
    for lib, version in m["versions"].items():
        if version is not None and not isinstance(version, str):
            return f"'versions.{lib}' is {version!r}; expected a version string"
    for key in _LIMIT_KEYS:
        v = m["limits"].get(key)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1 << 24:
            return f"'limits.{key}' is {v!r}; expected a whole number from 1 to {1 << 24}"
    frac = m["runtime"].get("kv_cache_free_gpu_memory_fraction")
    if not isinstance(frac, (int, float)) or isinstance(frac, bool) or not 0 < frac <= 1:
        return (f"'runtime.kv_cache_free_gpu_memory_fraction' is {frac!r}; expected a "
                f"fraction in (0, 1]")
    for key in ("kv_cache_enable_block_reuse", "enable_chunked_context"):
        if key in m["runtime"] and not isinstance(m["runtime"][key], bool):
            return f"'runtime.{key}' is {m['runtime'][key]!r}; expected true/false"
    return None


def manifest_problem(manifest: dict, gpu, versions: dict) -> str | None:
    """Why the engine described by ``manifest`` cannot run here (None when it can).

    Checks the quantization against this GPU (an FP8 engine needs sm89+), then compute
    capability, GPU name, and the exact TensorRT and TensorRT-LLM versions (an engine plan is
    specific to all of them).
    """
    from qwen_trt.engine.quant import QuantError, check_gpu, manifest_quant

    spec = manifest_quant(manifest)
    try:
        check_gpu(spec, gpu, f"its quantization {spec.name}" if spec else "")
    except QuantError as e:
        return str(e).rstrip(".")
    built = manifest["gpu"]
    if built.get("compute_capability") != gpu.cc:
        return (f"built for {built.get('name')} (sm{str(built.get('compute_capability')).replace('.', '')}), "
                f"this GPU is {gpu.name} ({gpu.sm})")
    if built.get("name") != gpu.name:
        return f"built for {built.get('name')}, this GPU is {gpu.name}"
    for lib in ("tensorrt_llm", "tensorrt"):
        want, have = manifest["versions"].get(lib), versions.get(lib)
        if want != have:
            return f"built with {lib} {want}, this machine has {lib} {have}"
    return None


def check_manifest(engine_dir: Path, manifest: dict, gpu, versions: dict,
                   suggestion: str | None) -> None:
    why = manifest_problem(manifest, gpu, versions)
    if why is None:
        return
    if why.startswith("its quantization "):   # this GPU cannot run it: no rebuild here helps
        raise EngineMismatchError(f"Engine {engine_dir} cannot run here: {why}.")
    profile = (manifest.get("profile") or {}).get("name", "<gpu>")
    target = suggestion or profile
    raise EngineMismatchError(
        f"Engine {engine_dir} cannot run here: {why}. Rebuild it for this machine with "
        f"`make engine GPU={target}`.")
