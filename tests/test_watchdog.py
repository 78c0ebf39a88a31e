"""A hung engine is noticed: with ``--watchdog-s``, a worker that makes no
progress while requests are in it (here: stopped with SIGSTOP) is killed and restarted; the
request in flight gets one clear error, the service is not ready meanwhile (``/health`` 503),
and the next request is answered. A long step that still runs (a long prefill) beats and is
not killed. A queued streaming HTTP client gets SSE ``: keep-alive`` comments while it waits."""
from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from qwen_trt.api.server import ServerSettings, create_app
from qwen_trt.backends import BackendConfig
from qwen_trt.serving.session import ChatSession
from qwen_trt.errors import ConfigError
from qwen_trt.options import add_backend_args, config_from
from qwen_trt.params import SamplingParams
from qwen_trt.serving.client import WorkerClient
from qwen_trt.serving.events import Delta, WorkerStoppedError
from qwen_trt.serving.worker import WorkerSpec
from servers import wait_for  # noqa: E402

WATCH_S = 2.0
TIMEOUT = 120       # only a hang (or a very loaded machine restarting a worker) reaches it
LONG = SamplingParams(max_new_tokens=4000, temperature=0, ignore_eos=True)   # until cancelled
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)


def _prompt(tokenizer, text: str) -> list[int]:
    return ChatSession(tokenizer).prepare(text, max_input_len=1000, max_seq_len=2048,
                                          max_new_tokens=16).ids


def test_a_stopped_worker_is_killed_restarted_and_its_request_fails_clearly(tiny_model_dir,
                                                                           tiny_tokenizer):
    client = WorkerClient(WorkerSpec(BackendConfig(backend="torch", model=str(tiny_model_dir),
                                                   device="cpu", warmup=False,
                                                   watchdog_s=WATCH_S)))
    old = client.pid
    try:
        health = TestClient(create_app(client))
        assert health.get("/health").status_code == 200
        ids = _prompt(tiny_tokenizer, "hi")
        handle = client.submit(ids, LONG)
        events = handle.events(poll_s=0.01)            # kept: closing the reader cancels
        assert any(isinstance(ev, Delta) for ev in events)   # it streams
        os.kill(old, signal.SIGSTOP)                   # hung: alive, but makes no progress
        assert handle.wait(60), "the request in flight still waits on the hung engine"
        with pytest.raises(WorkerStoppedError) as err:
            handle.result(0)
        assert str(err.value) == ("The worker stopped making progress (nothing for 2 s, "
                                  "--watchdog-s) and is being restarted; your chat is kept — "
                                  "send again.")
        assert handle.text                             # what streamed before stays
        st = client.status()
        assert st.state in ("stopped", "restarting") and st.restarts == 1
        assert health.get("/health").status_code == 503
        ok = client.submit(ids, GREEDY).result(TIMEOUT)      # after the restart
        assert ok.metrics.tokens == GREEDY.max_new_tokens
        assert client.pid != old and client.status().state == "ready"
        assert health.get("/health").status_code == 200
        with pytest.raises(ProcessLookupError):
            os.kill(old, 0)                            # the stopped process is gone
    finally:
        client.close()
        try:                                           # without the watchdog: still stopped
            os.kill(old, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_long_step_that_still_runs_is_not_killed(tiny_model_dir, tiny_tokenizer):
    """A "slow" prompt spends 4 s in one step (serving_fakes.SLOW_FIRST_S), four times the
    watchdog's limit: the worker's heartbeat keeps it alive."""
    client = WorkerClient(WorkerSpec(BackendConfig(model=str(tiny_model_dir), watchdog_s=1.0),
                                     loader="serving_fakes:load_echo",
                                     runner="serving_fakes:RoundRobinRunner"))
    try:
        ids = tiny_tokenizer.encode("slow and steady", add_special_tokens=False)
        reply = client.submit(ids, SamplingParams(max_new_tokens=len(ids))).result(TIMEOUT)
        assert reply.text == "slow and steady"
        st = client.status()
        assert st.restarts == 0 and st.state == "ready"
    finally:
        client.close()


def test_an_idle_engine_is_left_alone(tiny_model_dir):
    """No requests: nothing to make progress on, so a stopped worker is not the watchdog's."""
    client = WorkerClient(WorkerSpec(BackendConfig(model=str(tiny_model_dir), watchdog_s=0.5),
                                     loader="serving_fakes:load_echo",
                                     runner="serving_fakes:RoundRobinRunner"))
    try:
        assert client._stalled_s() is None
        assert client._watchdog is not None and client._watchdog.limit_s == 0.5
    finally:
        client.close()


def test_watchdog_setting(monkeypatch):
    p = argparse.ArgumentParser()
    add_backend_args(p)
    assert config_from(p.parse_args([]), {}).watchdog_s == 30.0
    assert config_from(p.parse_args(["--watchdog-s", "2.5"]), {}).watchdog_s == 2.5
    assert config_from(p.parse_args([]), {"QWEN_TRT_WATCHDOG_S": "0"}).watchdog_s == 0
    for bad in ("soon", "-1", "inf", "nan"):
        with pytest.raises(ConfigError, match=r"--watchdog-s / QWEN_TRT_WATCHDOG_S must be a "
                                              r"number of seconds >= 0"):
            config_from(p.parse_args(["--watchdog-s", bad]), {})


# -- a queued streaming client ------------------------------------------------------------------
def test_a_queued_stream_gets_sse_keepalive_comments(tiny_tokenizer):
    from fakes import ScriptedBackend
    from servers import app_in_thread

    from qwen_trt.serving.service import InferenceService

    backend = ScriptedBackend(tiny_tokenizer, "done")
    backend.gate.clear()                               # the first request holds the engine
    service = InferenceService(backend)
    app = create_app(service, ServerSettings(sse_keepalive_s=0.2), model_name="fake")
    release = threading.Timer(30, backend.gate.set)    # a bound, should the test go wrong
    release.start()
    try:
        with app_in_thread(app) as origin:
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            first = threading.Thread(target=httpx.post, args=(f"{origin}/v1/chat/completions",),
                                     kwargs={"json": {**body, "stream": False}, "timeout": 60})
            first.start()
            assert wait_for(lambda: service.status().busy, 30)
            lines, seen_before_release = [], False
            with httpx.stream("POST", f"{origin}/v1/chat/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if line == ": keep-alive" and not backend.gate.is_set():
                        seen_before_release = True
                        assert service.status().queued == 1        # it waits in the queue
                        backend.gate.set()
            first.join(30)
        assert seen_before_release, lines
        data = [x for x in lines if x.startswith("data: ")]
        assert data[-1] == "data: [DONE]", lines
        chunks = [json.loads(x[len("data: "):]) for x in data[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c.get("choices"))
        assert text == "done", lines
    finally:
        release.cancel()
        backend.gate.set()
        service.close()


def test_sse_keepalive_setting():
    from qwen_trt.commands.serve import settings_from

    args = argparse.Namespace(host=None, port=None, api_key=None, max_queue=None,
                              served_model_name=None, sse_keepalive_s=None, max_body_mb=None,
                              header_timeout_s=None, body_timeout_s=None, shutdown_grace_s=None,
                              allowed_origins=None)
    assert settings_from(args, {}).sse_keepalive_s == 10.0
    assert settings_from(args, {"QWEN_TRT_SSE_KEEPALIVE_S": "2.5"}).sse_keepalive_s == 2.5
    with pytest.raises(ConfigError, match="--sse-keepalive-s must be a number"):
        settings_from(argparse.Namespace(**{**vars(args), "sse_keepalive_s": "x"}), {})
    with pytest.raises(ConfigError, match="--sse-keepalive-s must be >= 0"):
        ServerSettings(sse_keepalive_s=-1)
