"""What ``/health`` calls ready has done every one-time thing: the engine process has read its
tokenizer (a fast backend reads it on first use; read after ready it ran beside the first
requests), the client has warmed its own, and the API has worked out its prompt bound; no
first-use work is left for the first requests."""
from __future__ import annotations

import io
import os
import time

from fastapi.testclient import TestClient

from fakes import ScriptedBackend

from qwen_trt.api import server as server_mod
from qwen_trt.api.server import create_app
from qwen_trt.api.startup import LoadingGate
from qwen_trt.backends import BackendConfig
from qwen_trt.serving.client import WorkerClient
from qwen_trt.serving.service import InferenceService
from qwen_trt.serving.worker import WorkerSpec

TIMEOUT = 120


def test_the_engine_reads_its_tokenizer_before_it_says_ready(tiny_model_dir, tmp_path,
                                                             monkeypatch):
    mark = tmp_path / "tokenizer-loaded"
    monkeypatch.setenv("SERVING_FAKES_TOKENIZER_MARK", str(mark))
    client = WorkerClient(WorkerSpec(BackendConfig(model=str(tiny_model_dir)),
                                     loader="serving_fakes:load_lazy_tokenizer"),
                          echo=io.StringIO())
    try:
        ready_at = time.time()
        assert client.status().state == "ready"
        assert mark.exists(), "the engine read its tokenizer after it said ready"
        assert float(mark.read_text()) <= ready_at
        assert "tokenizer_wait_s" in client.timings
    finally:
        client.close()


def test_the_api_does_its_one_time_work_before_health_says_ready(tiny_tokenizer, monkeypatch):
    calls: list[float] = []
    real = server_mod.chars_per_token

    def counted(tok):
        calls.append(time.monotonic())
        return real(tok)

    monkeypatch.setattr(server_mod, "chars_per_token", counted)
    service = InferenceService(ScriptedBackend(tiny_tokenizer, "Hello there!"))
    gate = LoadingGate(service, lambda: create_app(service, model_name="fake"))
    try:
        with TestClient(gate) as c:                 # the lifespan starts the gate's wait
            assert gate.ready.wait(TIMEOUT)
            assert c.get("/health").status_code == 200
            before = len(calls)
            assert before == 1                      # worked out once, before ready
            for body in ({"messages": [{"role": "user", "content": "hi"}]},
                         {"messages": [{"role": "user", "content": "a longer one " * 20}],
                          "stream": True},
                         {"messages": [{"role": "user", "content": "again"}], "n": 2}):
                r = c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
            assert len(calls) == before, "one-time work ran after /health said ready"
    finally:
        service.close()
