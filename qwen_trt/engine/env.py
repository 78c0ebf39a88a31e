"""What the TensorRT-LLM paths need from this machine: a tensorrt_llm of the right release for
the path (engine or LLM API), library versions for the manifest, and free disk space. Each
failure is one clear line."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import shutil
from pathlib import Path

from qwen_trt.errors import first_line, BackendUnavailableError, QwenTrtError

# The engine path: 1.0 is the first release whose TensorRT engine path knows Qwen3, but 1.0 and
# 1.1 pin transformers 4.53.1 / 4.56.0 while qwen-trt needs >= 4.57 (what 1.2 pins), and
# v1.3.0rc20 was announced as the last release with the TensorRT backend (see
# docs/tensorrt-llm.md). So engines need 1.2.x (the extra pins it), or a 1.3 RC up to rc20.
TRTLLM_MIN = (1, 2)
TRTLLM_MAX_EXCL = (1, 3)
TRTLLM_SPEC = "tensorrt_llm>=1.2,<1.3"
ENGINE_LAST_RELEASE = "1.3.0rc20"          # the last release with the TensorRT engine backend
# The LLM API path (PyTorch backend, the checkpoint loaded directly): every release from 1.2.
LLMAPI_MIN = (1, 2)
LLMAPI_SPEC = "tensorrt_llm>=1.2"

INSTALL_HINT = (
    f'install it from the qwen-trt folder with `pip install -e ".[trtllm]"` (i.e. {TRTLLM_SPEC}) on Linux x86_64/aarch64 '
    "with an NVIDIA GPU, after `sudo apt-get install -y libopenmpi-dev`; its wheel comes from "
    "NVIDIA's package index (pypi.nvidia.com), so that index must be reachable; or use the NGC "
    "container nvcr.io/nvidia/tensorrt-llm/release:1.2.1. See docs/tensorrt-llm.md")


class TrtllmNotInstalledError(BackendUnavailableError):
    """tensorrt_llm is missing, broken, or of a version without the TensorRT engine path."""


class NoEngineBuilderError(TrtllmNotInstalledError):
    """The installed tensorrt_llm is a release after 1.3.0rc20: it has no TensorRT engine
    backend (no builder, no engine runtime)."""


class NotEnoughDiskError(QwenTrtError):
    """The build would run out of disk space."""


def parse_version(text: str) -> tuple[int, int]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
    while len(parts) < 2:
        parts.append(0)
    return parts[0], parts[1]


def version_supported(text: str) -> bool:
    """Whether ``text`` is a release the ``.[trtllm]`` extra pins for engines (1.2.x)."""
    return TRTLLM_MIN <= parse_version(text) < TRTLLM_MAX_EXCL


_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?(?:(a|b|rc)(\d+))?")
_STAGE = {"a": 0, "b": 1, "rc": 2, None: 3}


def release_key(text: str) -> tuple[int, int, int, int, int]:
    """``"1.3.0rc20"`` -> (1, 3, 0, 2, 20): ordered like PEP 440 for plain and pre-releases
    (an a/b/rc release sorts before the final one)."""
    m = _RELEASE.match(text.strip())
    if not m:
        return (0, 0, 0, 0, 0)
    major, minor, patch, stage, n = m.groups()
    return (int(major), int(minor), int(patch or 0), _STAGE[stage], int(n or 0))


def has_engine_backend(text: str) -> bool:
    """Whether release ``text`` can build and run TensorRT engines: from 1.2 up to 1.3.0rc20
    (after it the TensorRT backend was removed: docs/tensorrt-llm.md, "Versions")."""
    key = release_key(text)
    return release_key("1.2") <= key <= release_key(ENGINE_LAST_RELEASE)


def has_llm_api(text: str) -> bool:
    """Whether release ``text`` serves a checkpoint through the PyTorch-backend LLM API as
    qwen-trt uses it (``tensorrt_llm.LLM`` is the PyTorch one from 1.0; 1.2 is the first whose
    transformers pin fits qwen-trt's)."""
    return parse_version(text) >= LLMAPI_MIN


NO_ENGINE_BUILDER = (
    "tensorrt_llm {version} builds and runs no TensorRT engines (the TensorRT backend was removed "
    "after " + ENGINE_LAST_RELEASE + "): run `--backend trtllm --model <checkpoint>`, which loads "
    "the Hugging Face checkpoint directly on its PyTorch backend (no engine build needed); for "
    'engines install 1.2.x (`pip install -e ".[trtllm]"`, or the 1.2.1 container '
    "docker/Dockerfile)")


def installed_trtllm_version() -> str | None:
    """The installed tensorrt_llm version from package metadata (cheap: no import)."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return None
    for dist in ("tensorrt_llm", "tensorrt-llm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def trtllm_available() -> bool:
    """Cheap check (no import): a tensorrt_llm that runs engines is installed."""
    try:
        v = installed_trtllm_version()
    except Exception:  # noqa: BLE001 - must never raise
        return False
    return v is not None and (v == "unknown" or has_engine_backend(v))


def require_trtllm(path: str = "engine"):
    """Import ``tensorrt_llm`` (slow: seconds) and check its release for ``path`` ("engine":
    build or run engines; "llmapi": serve a checkpoint through the LLM API); return the module."""
    try:
        trtllm = importlib.import_module("tensorrt_llm")
    except ImportError as e:
        if getattr(e, "name", None) == "tensorrt_llm":
            raise TrtllmNotInstalledError(f"TensorRT-LLM is not installed: {INSTALL_HINT}.") from e
        raise TrtllmNotInstalledError(
            f"tensorrt_llm is installed but does not import ({first_line(e)}): "
            f"{INSTALL_HINT}.") from e
    except Exception as e:  # missing libmpi, CUDA mismatch...
        first = (first_line(e) or type(e).__name__)
        raise TrtllmNotInstalledError(
            f"tensorrt_llm fails to import ({type(e).__name__}: {first}); a missing libmpi means "
            f"`sudo apt-get install -y libopenmpi-dev`: {INSTALL_HINT}.") from e
    version = str(getattr(trtllm, "__version__", "unknown"))
    if version == "unknown":
        return trtllm
    if path == "llmapi":
        if not has_llm_api(version):
            raise TrtllmNotInstalledError(
                f"tensorrt_llm {version} is installed, but the LLM API path needs {LLMAPI_SPEC} "
                f"(1.0/1.1 pin a transformers older than 4.57, 0.x has no PyTorch-backend LLM "
                f'for Qwen3): run `pip install -e ".[trtllm-llmapi]"`.')
        return trtllm
    if release_key(version) > release_key(ENGINE_LAST_RELEASE):
        raise NoEngineBuilderError(NO_ENGINE_BUILDER.format(version=version) + ".")
    if not has_engine_backend(version):
        raise TrtllmNotInstalledError(
            f"tensorrt_llm {version} is installed, but qwen-trt's engine path needs {TRTLLM_SPEC} "
            f"(or a 1.3 RC up to {ENGINE_LAST_RELEASE}): 1.0/1.1 pin a transformers older than "
            f"4.57 and 0.x cannot convert Qwen3. "
            f'Run `pip install -e ".[trtllm]"`.')
    return trtllm


def library_versions() -> dict[str, str | None]:
    """Versions recorded in (and checked against) the engine manifest."""
    out: dict[str, str | None] = {}
    for mod in ("tensorrt_llm", "tensorrt", "torch"):
        out[mod] = module_version(mod)
    return out


def module_version(mod: str) -> str | None:
    import sys

    m = sys.modules.get(mod)
    if m is not None and getattr(m, "__version__", None):
        return str(m.__version__)
    for dist in (mod, mod.replace("_", "-")):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    if importlib.util.find_spec(mod) is None:
        return None
    try:
        return str(getattr(importlib.import_module(mod), "__version__", None))
    except Exception:  # noqa: BLE001
        return None


def free_bytes(path: Path) -> int:
    """Free space on the file system that holds ``path`` (or its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def require_disk(path: Path, need_bytes: int, what: str) -> None:
    free = free_bytes(path)
    if free < need_bytes:
        raise NotEnoughDiskError(
            f"Not enough disk space for {what} in {path}: needs about {need_bytes / 1e9:.1f} GB, "
            f"{free / 1e9:.1f} GB free. Free some space or point --out-dir / --engines-dir at a "
            f"larger disk.")
