"""What the engine pipeline needs from this machine: TensorRT-LLM 1.2.x importable, library
versions for the manifest, and free disk space. Each failure is one clear line."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import shutil
from pathlib import Path

from qwen_trt.errors import first_line, BackendUnavailableError, QwenTrtError

# 1.0 is the first release whose TensorRT engine path knows Qwen3, but 1.0 and 1.1 pin
# transformers 4.53.1 / 4.56.0 while qwen-trt needs >= 4.57 (what 1.2 pins); 1.3 removed the
# TensorRT engine backend (see docs/tensorrt-llm.md). So: 1.2.x.
TRTLLM_MIN = (1, 2)
TRTLLM_MAX_EXCL = (1, 3)
TRTLLM_SPEC = "tensorrt_llm>=1.2,<1.3"

INSTALL_HINT = (
    f'install it from the qwen-trt folder with `pip install -e ".[trtllm]"` (i.e. {TRTLLM_SPEC}) on Linux x86_64/aarch64 '
    "with an NVIDIA GPU, after `sudo apt-get install -y libopenmpi-dev`; its wheel comes from "
    "NVIDIA's package index (pypi.nvidia.com), so that index must be reachable; or use the NGC "
    "container nvcr.io/nvidia/tensorrt-llm/release:1.2.1. See docs/tensorrt-llm.md")


class TrtllmNotInstalledError(BackendUnavailableError):
    """tensorrt_llm is missing, broken, or of a version without the TensorRT engine path."""


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
    return TRTLLM_MIN <= parse_version(text) < TRTLLM_MAX_EXCL


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
    """Cheap check (no import): a supported tensorrt_llm is installed."""
    try:
        v = installed_trtllm_version()
    except Exception:  # noqa: BLE001 - must never raise
        return False
    return v is not None and (v == "unknown" or version_supported(v))


def require_trtllm():
    """Import ``tensorrt_llm`` (slow: seconds) and check its version; return the module."""
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
    if version != "unknown" and not version_supported(version):
        raise TrtllmNotInstalledError(
            f"tensorrt_llm {version} is installed, but qwen-trt needs {TRTLLM_SPEC}: 1.3 removed "
            f"the TensorRT engine backend, 1.0/1.1 pin a transformers older than 4.57 and 0.x "
            f"cannot convert Qwen3. "
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
