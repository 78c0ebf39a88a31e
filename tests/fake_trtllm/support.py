"""Fixtures for the fake TensorRT-LLM: put ``tests/fake_trtllm`` on sys.path, pretend a GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

FAKE_DIR = Path(__file__).resolve().parent
FAKE_13_DIR = FAKE_DIR.parent / "fake_trtllm_13"   # a release after 1.3.0rc20: LLM API only

# torch.cuda.get_device_name / capability / total memory as real cards report them
GPUS = {
    "a10": ("NVIDIA A10", (8, 6), 22.06),
    "a10g": ("NVIDIA A10G", (8, 6), 22.3),
    "l4": ("NVIDIA L4", (8, 9), 22.5),
    "rtx4090": ("NVIDIA GeForce RTX 4090", (8, 9), 23.6),
    "a100": ("NVIDIA A100-SXM4-80GB", (8, 0), 79.2),
    "a100-40": ("NVIDIA A100-PCIE-40GB", (8, 0), 39.4),
    "h100": ("NVIDIA H100 80GB HBM3", (9, 0), 79.1),
    "h200": ("NVIDIA H200", (9, 0), 139.8),
}


def _purge() -> None:
    for name in list(sys.modules):
        if name in ("tensorrt", "tensorrt_llm") or name.startswith(("tensorrt_llm.", "tensorrt.")):
            del sys.modules[name]


def _install(monkeypatch, folder: Path):
    import importlib

    _purge()
    monkeypatch.syspath_prepend(str(folder))
    importlib.invalidate_caches()
    import tensorrt_llm

    tensorrt_llm.CALLS.clear()
    return tensorrt_llm


@pytest.fixture
def fake_trtllm(monkeypatch):
    """Import the fake ``tensorrt_llm`` 1.2.1 (engine builder, executor, LLM API) for this test;
    returns the module."""
    yield _install(monkeypatch, FAKE_DIR)
    _purge()


@pytest.fixture
def fake_trtllm_13(monkeypatch):
    """Import the fake ``tensorrt_llm`` 1.3.0 (PyTorch-backend LLM API only, no engine builder)
    for this test; returns the module."""
    yield _install(monkeypatch, FAKE_13_DIR)
    _purge()


def set_gpu(monkeypatch, key: str | None):
    """Make qwen_trt.engine.gpu.detect_gpu report one of GPUS (None: no GPU)."""
    from qwen_trt.engine import gpu as gpu_mod
    info = None if key is None else gpu_mod.GpuInfo(*GPUS[key])
    monkeypatch.setattr(gpu_mod, "detect_gpu", lambda index=0: info)
    return info


def calls(trtllm, name: str) -> list[dict]:
    return [kw for n, kw in trtllm.CALLS if n == name]
