"""No silent slow path: a fast-path kernel family that fell back to much slower code is named
in one place (``qwen_trt.backends.kernel_paths``), ``serve`` refuses to start on it unless
``--allow-slow-fallback``, ``/health`` and ``/metrics`` name each family's path and the app's
sidebar says so. The fallback is injected (CPU: no kernel falls back by itself here); the
compile cache's folders are checked writable before a kernel compiles."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import streamlit as st
from fastapi.testclient import TestClient
from streamlit.testing.v1 import AppTest

from fakes import ScriptedBackend

from qwen_trt.api.server import create_app
from qwen_trt.backends.kernel_paths import (SlowFallbackError, kernel_paths, slow_fallback_line,
                                            with_kernel_paths)
from qwen_trt.cli import main
from qwen_trt.serving import service as serving
from qwen_trt.serving.service import InferenceService

APP = str(Path(__file__).resolve().parents[1] / "app.py")
WHY = ("triton decode attention unavailable: PermissionError: [Errno 13] Permission denied: "
       "'/cache/new'; using the math attention")


def _fast(device: str, attn: str = "triton", decode: str = "triton", notes=(), batched=None):
    """What a fast-path load leaves behind, as the one place reads it."""
    model = SimpleNamespace(attn_impl=attn, decode_impl=decode, device=SimpleNamespace(type=device))
    backend = SimpleNamespace(decoder=SimpleNamespace(model=model,
                                                      stats=SimpleNamespace(notes=list(notes))))
    runner = None
    if batched is not None:
        varlen, step_graphs, bnotes = batched
        runner = SimpleNamespace(model=SimpleNamespace(
            model=model, varlen=varlen, graphs=True, step_graphs=step_graphs,
            stats=SimpleNamespace(notes=list(bnotes))))
    return backend, runner


def test_each_family_path_and_its_fallback_from_one_place():
    kp = kernel_paths(*_fast("cuda"))
    assert kp.paths == {"attention": "triton", "decode": "triton"} and kp.slow == {}
    kp = kernel_paths(*_fast("cuda", "math", "torch", notes=[WHY]))
    assert kp.paths == {"attention": "math", "decode": "torch"}
    assert kp.slow["attention"] == WHY and set(kp.slow) == {"attention", "decode"}
    kp = kernel_paths(*_fast("cuda", batched=(False, False, [
        "varlen step unavailable: RuntimeError: x; using the math attention for steps that "
        "prefill"])))
    assert kp.paths["prefill"] == "math" and kp.paths["step_graphs"] == "eager"
    assert "varlen step unavailable" in kp.slow["prefill"] and set(kp.slow) == {"prefill",
                                                                                 "step_graphs"}
    # on the CPU every family runs PyTorch by design: no fallback
    assert kernel_paths(*_fast("cpu", "math", "torch")).slow == {}
    assert kernel_paths(SimpleNamespace(), None) is None       # no fast path: nothing to say


def _slow_backend(tok):
    b = ScriptedBackend(tok, "Hello there!", max_seq_len=4096)
    backend, _ = _fast("cuda", "math", "triton", notes=[WHY])
    b._info = with_kernel_paths(b._info, backend)
    return b


def test_the_refusal_is_one_line_naming_the_family_and_why(tiny_tokenizer):
    line = slow_fallback_line(_slow_backend(tiny_tokenizer).info)
    assert line.startswith("The fast path fell back to much slower kernels: attention runs "
                           "'math' instead of 'triton' (triton decode attention unavailable: "
                           "PermissionError")
    assert "--allow-slow-fallback" in line and "\n" not in line
    assert slow_fallback_line(ScriptedBackend(tiny_tokenizer, "x").info) is None


@pytest.fixture
def slow_load(monkeypatch, tiny_tokenizer):
    """The engine in this process (tests' QWEN_TRT_WORKER=inline) loads a slow-path backend."""
    monkeypatch.setattr(serving, "load_backend", lambda cfg: _slow_backend(tiny_tokenizer))
    monkeypatch.setattr(serving, "worker_mode", lambda mode=None: "inline")


def test_serve_refuses_a_slow_fallback_in_one_line(slow_load, capsys, tiny_model_dir):
    from servers import free_port

    code = main(["serve", "--model", str(tiny_model_dir), "--port", str(free_port())])
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if not x.startswith("loading the model")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "attention runs 'math' instead of 'triton'" in lines[0] and "Permission denied" in lines[0]
    with pytest.raises(SlowFallbackError):
        serving.start_service(serving.BackendConfig(model="x"), refuse_slow=True)
    allowed = serving.start_service(serving.BackendConfig(model="x"), refuse_slow=False)
    allowed.close()


def test_health_and_metrics_name_the_paths(tiny_tokenizer):
    service = InferenceService(_slow_backend(tiny_tokenizer))
    try:
        with TestClient(create_app(service, model_name="fake")) as c:
            body = c.get("/health").json()
            assert body["status"] == "ready"
            assert body["kernels"] == {"attention": "math", "decode": "triton"}
            assert body["slow_fallbacks"] == {"attention": WHY}
            text = c.get("/metrics").text
            assert ('qwen_trt_kernel_path{fallback="1",family="attention",path="math"} 1.0'
                    in text), text
            assert 'qwen_trt_kernel_path{fallback="0",family="decode",path="triton"} 1.0' in text
    finally:
        service.close()


def test_the_app_shows_the_slow_path(slow_load, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["app.py"])
    st.cache_resource.clear()
    try:
        at = AppTest.from_file(APP, default_timeout=30).run()
        assert not at.exception, [e.value for e in at.exception]
        notes = [c.value for c in at.sidebar.caption if "Slow path" in c.value]
        assert len(notes) == 1 and "attention runs `math`" in notes[0], notes
        assert "Permission denied" in notes[0]
    finally:
        st.cache_resource.clear()


def test_the_compile_cache_checks_its_folders_and_an_inherited_triton_dir(tmp_path, monkeypatch):
    from qwen_trt.fast import compile_cache as cc

    root = cc.cache_root("relative-cache")              # absolute once, whatever comes later
    assert root.is_absolute() and root.name == "relative-cache"
    key = cc.CacheKey(*(["x"] * 10))
    lines: list[str] = []
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")                              # Triton could not make its folders here
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocked / "triton"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))
    cache = cc.CompileCache(tmp_path / "root", key, say=lines.append).open()
    import os

    assert os.environ["TRITON_CACHE_DIR"] == str(cache.folder / "triton")      # replaced
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "theirs")    # usable: kept
    assert len(lines) == 1 and "TRITON_CACHE_DIR=" in lines[0] and "not writable" in lines[0]
    assert cc.writable_problem(blocked / "x") is not None
    with pytest.raises(OSError, match="is not writable"):
        cc.CompileCache(blocked, key, say=lines.append).open()
