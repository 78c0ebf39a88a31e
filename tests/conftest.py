"""Shared fixtures: one tiny Qwen3 checkpoint per test session, and marker-based skips."""
from __future__ import annotations

import importlib.util
import os
import shutil

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def pytest_collection_modifyitems(config, items):
    skips = {
        "cuda": (not _has_cuda(), "needs an NVIDIA GPU (CUDA build of torch)"),
        "trtllm": (importlib.util.find_spec("tensorrt_llm") is None or not _has_cuda(),
                   "needs tensorrt_llm 1.2.x and a GPU"),
        "browser": (shutil.which("chromium") is None and shutil.which("chromium-browser") is None,
                    "needs Debian's chromium (apt-get install chromium)"),
    }
    for item in items:
        for mark, (skip, why) in skips.items():
            if skip and item.get_closest_marker(mark) is not None:
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The offline tiny Qwen3 checkpoint, written once per test session."""
    from qwen_trt.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for a module of tiny tensor work (two threads on a busy
    2-core box spin and make a tiny forward ~50x slower); the setting is put back after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_backend(tiny_model_dir):
    """A torch backend on the tiny model (CPU, float32), shared by tests that only read it."""
    from qwen_trt.backends.torch_backend import TorchBackend

    return TorchBackend.load(str(tiny_model_dir), device="cpu", warmup=False)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_backend):
    return tiny_backend.tokenizer


# The suite runs the engine in process (tests patch backends in this process); the tests of the
# engine process (tests/test_serving_worker.py) start it explicitly.
os.environ.setdefault("QWEN_TRT_WORKER", "inline")
