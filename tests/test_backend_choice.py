"""`--backend auto`: an engine for this GPU wins, unless the user named another model."""
import json

import pytest

from qwen_trt import backends
from qwen_trt.backends import BackendConfig, choose_backend, engine_built_from


@pytest.fixture
def engine(tmp_path, monkeypatch):
    d = tmp_path / "engines" / "h200"
    d.mkdir(parents=True)
    (tmp_path / "ckpt").mkdir()
    (d / "manifest.json").write_text(json.dumps(
        {"model": {"source": "Qwen/Qwen3-4B-Instruct-2507", "path": str(tmp_path / "ckpt")}}))
    import qwen_trt.backends.trtllm_backend as trt

    monkeypatch.setattr(trt, "auto_engine_dir", lambda: d)
    return d


def test_auto_takes_the_engine_for_the_default_or_same_model(engine, tmp_path, monkeypatch):
    assert choose_backend(BackendConfig()) == "trtllm"
    assert choose_backend(BackendConfig(model="Qwen/Qwen3-4B-Instruct-2507")) == "trtllm"
    monkeypatch.chdir(tmp_path)
    assert choose_backend(BackendConfig(model="./ckpt")) == "trtllm"   # same folder, other spelling


def test_auto_serves_another_named_model_with_torch(engine, tmp_path):
    (tmp_path / "other").mkdir()
    assert choose_backend(BackendConfig(model=str(tmp_path / "other"))) == "torch"
    assert not engine_built_from(engine, "someone/else")
    assert choose_backend(BackendConfig(backend="trtllm", model="someone/else")) == "trtllm"


def test_no_engine_means_torch(monkeypatch):
    import qwen_trt.backends.trtllm_backend as trt

    monkeypatch.setattr(trt, "auto_engine_dir", lambda: None)
    assert choose_backend(BackendConfig()) == "torch"
    assert choose_backend(BackendConfig(engine="engines/a10")) == "trtllm"
    assert backends.BACKENDS == ("auto", "torch", "trtllm", "openai")
