"""Which NVIDIA GPU is here (name, compute capability, memory) and which build profile fits it.

Detection goes through ``torch.cuda`` (already a dependency); tests monkeypatch
:func:`detect_gpu` to pretend a GPU is present.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from qwen_trt.engine.profiles import BuildProfile
from qwen_trt.errors import BackendUnavailableError, QwenTrtError

MEMORY_TOLERANCE = 0.95   # a card may report a little less than the nominal size


class NoGpuError(BackendUnavailableError):
    """No CUDA GPU is visible."""


class GpuMismatchError(QwenTrtError):
    """The GPU here is not the one a profile (or engine) was made for."""


@dataclass(frozen=True)
class GpuInfo:
    name: str                              # torch.cuda.get_device_name(): "NVIDIA A10"
    compute_capability: tuple[int, int]    # (8, 6)
    memory_gib: float                      # total memory
    index: int = 0

    @property
    def cc(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    @property
    def sm(self) -> str:
        return f"sm{self.compute_capability[0]}{self.compute_capability[1]}"

    @property
    def short_name(self) -> str:
        return re.sub(r"^NVIDIA\s+", "", self.name)

    def describe(self) -> str:
        return f"{self.short_name} ({self.sm}, {self.memory_gib:.0f} GiB)"


def detect_gpu(index: int = 0) -> GpuInfo | None:
    """The CUDA device ``index`` as torch sees it, or None (no torch CUDA, no driver, no GPU)."""
    try:
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() <= index:
            return None
        props = torch.cuda.get_device_properties(index)
        return GpuInfo(name=torch.cuda.get_device_name(index),
                       compute_capability=(int(props.major), int(props.minor)),
                       memory_gib=props.total_memory / 2**30, index=index)
    except Exception:  # broken driver, CPU-only build...: same as "no GPU" for our purposes
        return None


def require_gpu() -> GpuInfo:
    gpu = detect_gpu()
    if gpu is None:
        raise NoGpuError(
            "No NVIDIA GPU is visible to PyTorch (torch.cuda.is_available() is False): building "
            "and running TensorRT-LLM engines needs a GPU with a driver and the CUDA build of torch.")
    return gpu


def mismatch_reason(gpu: GpuInfo, profile: BuildProfile) -> str | None:
    """Why ``profile`` does not fit ``gpu`` (None when it fits)."""
    want = profile.gpu
    if gpu.cc != want.compute_capability:
        return f"profile {profile.name} wants {want.sm}"
    if not re.search(want.name_pattern, gpu.name, flags=re.IGNORECASE):
        return f"profile {profile.name} wants a GPU named like /{want.name_pattern}/"
    if gpu.memory_gib < want.memory_gib * MEMORY_TOLERANCE:
        return (f"profile {profile.name} is sized for {want.memory_gib:.0f} GiB, this GPU has "
                f"{gpu.memory_gib:.1f} GiB")
    return None


def matching_profiles(gpu: GpuInfo, profiles: list[BuildProfile]) -> list[BuildProfile]:
    return [p for p in profiles if mismatch_reason(gpu, p) is None]


def suggest_profile(gpu: GpuInfo, profiles: list[BuildProfile]) -> str | None:
    """Name of the first profile that fits ``gpu`` (None if none does)."""
    fits = matching_profiles(gpu, profiles)
    return fits[0].name if fits else None


def check_profile_matches(gpu: GpuInfo, profile: BuildProfile,
                          profiles: list[BuildProfile]) -> None:
    """Raise :class:`GpuMismatchError` with the profile to use instead."""
    why = mismatch_reason(gpu, profile)
    if why is None:
        return
    better = suggest_profile(gpu, profiles)
    fix = (f"run `make engine GPU={better}`" if better else
           f"copy build/profiles/{profile.name}.toml to a new file, set [gpu] for this card, "
           f"and run `make engine GPU=<that name>`")
    raise GpuMismatchError(f"This GPU is {_article(gpu.short_name)} {gpu.short_name} ({gpu.sm}); "
                           f"{why}: {fix}.")


def _article(name: str) -> str:
    """ "an H200", "an A10", "a GeForce RTX 4090" (by how the first letter is spoken)."""
    return "an" if name[:1].upper() in "AEFHILMNORSX8" else "a"
