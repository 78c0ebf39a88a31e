"""The engine in its own process (WorkerClient + worker): the InferenceService behaviour through a
spawned worker, admission with a batching runner, faults (a killed worker, a CUDA error, load
errors) and restarts. One worker per fixture per module: a spawn costs seconds on 2 cores."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from service_checks import (check_cancel_mid_reply_leaves_engine_clean,
                            check_threads_get_their_own_replies)

from qwen_trt.backends import BackendConfig
from qwen_trt.serving.generation import ReplyStream
from qwen_trt.serving.session import ChatSession
from qwen_trt.errors import ModelSourceError, QwenTrtError
from qwen_trt.params import SamplingParams
from qwen_trt.serving import service as service_mod
from qwen_trt.serving.client import WorkerClient
from qwen_trt.serving.events import (Delta, RequestFailedError, ModelLoadError,
                                     WorkerStoppedError, Failed, Finished, Started, Waiting)
from qwen_trt.serving.worker import WorkerSpec

GREEDY = SamplingParams(max_new_tokens=16, temperature=0)
LONG = SamplingParams(max_new_tokens=4000, temperature=0, ignore_eos=True)   # until cancelled
TIMEOUT = 120  # seconds; only a hang (or a very loaded machine restarting a worker) reaches it


def _prompt(tokenizer, text: str) -> list[int]:
    plan = ChatSession(tokenizer).prepare(text, max_input_len=1000, max_seq_len=2048,
                                          max_new_tokens=GREEDY.max_new_tokens)
    return plan.ids


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The tiny model on the torch backend in a worker process (SerialRunner: one at a time)."""
    client = WorkerClient(WorkerSpec(BackendConfig(backend="torch", model=str(tiny_model_dir),
                                                   device="cpu", warmup=False)))
    yield client
    client.close()


@pytest.fixture(scope="module")
def echo(tiny_model_dir):
    """A fake engine in a worker process: EchoBackend under a 4-at-once batching runner."""
    client = WorkerClient(WorkerSpec(BackendConfig(model=str(tiny_model_dir)),
                                     loader="serving_fakes:load_echo",
                                     runner="serving_fakes:RoundRobinRunner"))
    yield client
    client.close()


def _events(handle) -> list:
    return list(handle.events(poll_s=0.01))


def _check_stream(evs, reply_text: str) -> None:
    """Started first (after heartbeats), deltas that add up to the reply, Finished last."""
    assert [type(e) for e in evs if not isinstance(e, Waiting)][0] is Started
    finished = [e for e in evs if isinstance(e, Finished)]
    assert len(finished) == 1 and evs[-1] is finished[0]
    assert "".join(e.text for e in evs if isinstance(e, Delta)) == reply_text
    assert finished[0].reply.text == reply_text


# -- the tiny model through the process (what tests/test_serving.py checks in process) ----------
def test_replies_match_the_in_process_path(tiny, tiny_backend, tiny_tokenizer):
    assert tiny.status().state == "ready" and tiny.max_concurrency == 1
    assert tiny.info.name == "torch" and tiny.pid != os.getpid()
    for text in ("Hello, how are you today?", "你好，世界！请用中文回答。🚀"):
        ids = _prompt(tiny_tokenizer, text)
        with ReplyStream(tiny_backend, ids, GREEDY) as rs:
            local = "".join(rs)
        expected = rs.reply
        handle = tiny.submit(ids, GREEDY)
        evs = _events(handle)
        reply = handle.result(0)
        _check_stream(evs, expected.text)
        assert reply.token_ids == expected.token_ids and local == expected.text
        assert reply.metrics.finish_reason == expected.metrics.finish_reason
        assert reply.metrics.tokens == expected.metrics.tokens
        assert reply.metrics.prompt_tokens == len(ids) and reply.metrics.ttft_ms > 0


def test_grammar_and_logprobs_come_through_the_process(tiny, tiny_backend, tiny_tokenizer):
    """A constrained request with logprobs: the same tokens, Delta token ids and logprobs as
    in process (they cross the worker protocol as tuples)."""
    import json

    from qwen_trt.params import Grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(max_new_tokens=48, temperature=0.8, seed=2, logprobs=3,
                            grammar=Grammar("json_schema", json.dumps(schema)))
    ids = _prompt(tiny_tokenizer, "Reply in JSON.")
    with ReplyStream(tiny_backend, ids, params) as rs:
        local = list(rs.deltas())
    handle = tiny.submit(ids, params)
    evs = _events(handle)
    reply = handle.result(0)
    assert reply.token_ids == rs.reply.token_ids and isinstance(json.loads(reply.text)["a"], int)
    remote = [e for e in evs if isinstance(e, Delta)]
    assert [t for d in remote for t in d.token_ids] == reply.token_ids
    got = [lp for d in remote for lp in d.logprobs]
    want = [lp for d in local for lp in d.logprobs]
    assert [lp.token_id for lp in got] == reply.token_ids and len(got) == len(want)
    for a, b in zip(got, want):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and 1 <= len(a.top) <= 3
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_requests_from_many_threads_each_get_their_own_reply(tiny, tiny_tokenizer):
    texts = ["one", "three three three", "The quick brown fox"]
    check_threads_get_their_own_replies(tiny, [_prompt(tiny_tokenizer, t) for t in texts],
                                        GREEDY, TIMEOUT)


def test_cancel_mid_reply_leaves_engine_clean(tiny, tiny_tokenizer):
    ids = _prompt(tiny_tokenizer, "Please explain how a GPU reads weights")
    check_cancel_mid_reply_leaves_engine_clean(tiny, ids, GREEDY, TIMEOUT)


def test_queue_positions_fifo_and_cancel(tiny, tiny_tokenizer):
    ids = _prompt(tiny_tokenizer, "hi")
    short = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    a = tiny.submit(ids, LONG)                 # runs until cancelled
    b, c, d = (tiny.submit(ids, short) for _ in range(3))
    assert (a.position, b.position, c.position, d.position) == (0, 1, 2, 3)
    assert (a.state, b.state) == ("running", "queued")
    st = tiny.status()
    assert st.busy and st.running == 1 and st.queued == 3

    events = c.events(poll_s=0.01)             # a queued reader sees heartbeats with its place
    first = next(events)
    assert isinstance(first, Waiting) and first.position == 2 and first.engine == ""

    b.cancel()                                 # finished at once, never reaches the engine
    assert (c.position, d.position) == (1, 2)
    assert b.done and b.result(0).metrics.finish_reason == "cancelled" and b.result(0).text == ""
    assert tiny.status().queued == 2

    a.cancel()                                 # frees the engine for c, then d
    rest = list(events)
    assert isinstance(rest[-1], Finished) and rest[-1].reply.metrics.tokens == 3
    assert d.result(TIMEOUT).metrics.tokens == 3
    assert a.result(0).metrics.finish_reason == "cancelled"
    assert a.started_at < c.started_at < d.started_at
    assert c.waited_s > 0 and tiny.status().queued == 0


def test_closing_the_reader_cancels_the_request(tiny, tiny_tokenizer):
    handle = tiny.submit(_prompt(tiny_tokenizer, "hi"), LONG)
    events = handle.events(poll_s=0.01)
    next(events)
    events.close()                              # e.g. the page was reloaded mid-reply
    assert handle.cancelled
    assert handle.result(TIMEOUT).metrics.finish_reason == "cancelled"
    ok = tiny.submit(_prompt(tiny_tokenizer, "hi"), SamplingParams(max_new_tokens=2,
                                                                   ignore_eos=True))
    assert ok.result(TIMEOUT).metrics.tokens == 2


# -- admission with a batching runner (max_concurrency 4) --------------------------------------
def _echo_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_batching_runner_admits_four_and_queues_the_rest(echo, tiny_tokenizer):
    assert echo.max_concurrency == 4
    long = [echo.submit(_echo_ids(tiny_tokenizer, f"long {i}"), LONG) for i in range(4)]
    texts = ["Hello there, friend.", "你好，世界！🚀 ok", "third one", "é ü ß ø"]
    queued = [echo.submit(_echo_ids(tiny_tokenizer, t),
                          SamplingParams(max_new_tokens=len(_echo_ids(tiny_tokenizer, t)) + 1))
              for t in texts]
    assert all(h.state == "running" for h in long)
    assert [h.position for h in queued] == [1, 2, 3, 4]
    st = echo.status()
    assert (st.running, st.queued, st.max_concurrency) == (4, 4, 4)

    collected: dict[int, list] = {}
    readers = [threading.Thread(target=lambda i=i, h=h: collected.__setitem__(i, _events(h)))
               for i, h in enumerate(queued)]
    for t in readers:
        t.start()
    for h in long:
        h.cancel()
    for t in readers:
        t.join(TIMEOUT)
    for i, text in enumerate(texts):
        _check_stream(collected[i], text)           # each its own, complete, in order
        assert collected[i][-1].reply.metrics.finish_reason == "stop"
    assert all(h.result(0).metrics.finish_reason == "cancelled" for h in long)
    st = echo.status()
    assert st.cached_tokens >= 3 * len(texts)      # the runner's per-request cached_tokens
    assert st.running == 0 and st.queued == 0


def test_backend_error_is_one_line_and_the_worker_goes_on(echo, tiny_tokenizer):
    bad = echo.submit(_echo_ids(tiny_tokenizer, "boom now"), GREEDY)
    evs = _events(bad)
    assert isinstance(evs[-1], Failed) and isinstance(evs[-1].error, RequestFailedError)
    assert "boom" in str(evs[-1].error) and "\n" not in str(evs[-1].error)
    with pytest.raises(QwenTrtError):
        bad.result(0)
    ok = echo.submit(_echo_ids(tiny_tokenizer, "fine"), GREEDY).result(TIMEOUT)
    assert ok.text.startswith("fine") and echo.status().restarts == 0


# -- faults: the worker dies -------------------------------------------------------------------
def test_killed_worker_fails_in_flight_requests_keeps_queued_ones_and_restarts(
        echo, tiny_tokenizer):
    old_pid, restarts = echo.pid, echo.status().restarts
    running = [echo.submit(_echo_ids(tiny_tokenizer, f"run {i}"), LONG) for i in range(4)]
    waiting = echo.submit(_echo_ids(tiny_tokenizer, "still here"),
                          SamplingParams(max_new_tokens=len(_echo_ids(tiny_tokenizer,
                                                                      "still here")) + 1))
    assert waiting.position == 1
    readers = [h.events(poll_s=0.01) for h in running]   # kept: closing one cancels it
    for r in readers:                                    # every reply has begun streaming
        assert any(isinstance(ev, Delta) for ev in r)    # (stops at the first delta)
    os.kill(old_pid, signal.SIGKILL)

    for h in running:
        h.wait(TIMEOUT)
        with pytest.raises(WorkerStoppedError) as err:
            h.result(0)
        msg = str(err.value)
        assert msg == ("The worker process stopped (killed by SIGKILL); your chat is kept — "
                       "send again to restart it.")
    assert running[0].text                                 # what streamed before stays
    # The queued request was not lost: the worker restarts for it, visibly.
    evs = _events(waiting)
    notes = [e.engine for e in evs if isinstance(e, Waiting) and e.engine]
    assert notes and notes[0].startswith("Restarting the worker")
    _check_stream(evs, "still here")
    st = echo.status()
    assert st.state == "ready" and st.restarts == restarts + 1 and echo.pid != old_pid


def test_cuda_error_stops_the_worker_and_the_next_request_restarts_it(echo, tiny_tokenizer):
    """A request that crashes the engine before its reply begins is run once more on the
    restarted engine (it may have been the crash's bystander); crashing it again, it fails,
    and the engine waits for the next request."""
    restarts = echo.status().restarts
    bad = echo.submit(_echo_ids(tiny_tokenizer, "cuda-crash please"), GREEDY)
    bad.wait(TIMEOUT)
    with pytest.raises(WorkerStoppedError, match=r"^The worker process stopped \(RuntimeError: "
                                                 r"CUDA error: an illegal memory access"):
        bad.result(0)
    assert echo.status().state == "stopped"
    assert echo.status().restarts == restarts + 1          # the one retry
    again = echo.submit(_echo_ids(tiny_tokenizer, "after"), GREEDY)
    assert echo.status().state == "restarting"
    assert again.result(TIMEOUT).text.startswith("after")
    assert echo.status().restarts == restarts + 2


def test_a_request_whose_reply_had_not_begun_survives_a_killed_worker(echo, tiny_tokenizer):
    """Killed while a request is admitted but before its first token (a long prefill): the
    request waits for the restarted engine and completes; nothing reaches its client but the
    wait (one Started, no Failed)."""
    restarts = echo.status().restarts
    text = "slow start"
    h = echo.submit(_echo_ids(tiny_tokenizer, text),
                    SamplingParams(max_new_tokens=len(_echo_ids(tiny_tokenizer, text)) + 1))
    deadline = time.monotonic() + TIMEOUT
    while h.state != "running" and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)                                       # inside the 4 s first step
    os.kill(echo.pid, signal.SIGKILL)
    evs = _events(h)
    assert not any(isinstance(e, Failed) for e in evs)
    assert sum(isinstance(e, Started) for e in evs) == 1
    _check_stream(evs, text)
    assert echo.status().restarts == restarts + 1 and echo.status().state == "ready"


def test_load_errors_are_one_line(tiny_model_dir):
    with pytest.raises(ModelSourceError, match="does not exist: pass --model"):
        WorkerClient(WorkerSpec(BackendConfig(model="/nowhere"),
                                loader="serving_fakes:load_fails_clearly"), echo=io.StringIO())
    with pytest.raises(ModelLoadError) as err:
        WorkerClient(WorkerSpec(BackendConfig(), loader="serving_fakes:load_crashes"),
                     echo=io.StringIO())
    assert str(err.value) == ("Unexpected error while loading the model "
                              "(RuntimeError: CUDA out of memory).")


def test_start_service_keeps_one_engine_per_process(monkeypatch):
    made = []

    class Stub:
        def __init__(self, spec, **kw):   # wait=, tokenizer_hint=, echo=
            self.spec, self.closed = spec, False
            made.append(self)

        def close(self):
            self.closed = True

    import qwen_trt.serving.client as client_mod

    monkeypatch.setattr(client_mod, "WorkerClient", Stub)
    monkeypatch.setattr("qwen_trt.serving.preflight.preflight", lambda cfg: None)  # no folders
    monkeypatch.setattr(service_mod, "_current", None)
    monkeypatch.delenv(service_mod.WORKER_ENV, raising=False)
    a = service_mod.start_service(BackendConfig(model="a"))
    b = service_mod.start_service(BackendConfig(model="b"))
    assert made == [a, b] and a.closed and not b.closed   # the first was stopped first
    with pytest.raises(QwenTrtError, match="QWEN_TRT_WORKER must be one of"):
        service_mod.start_service(BackendConfig(), mode="threads")


def test_cli_chat_runs_the_engine_in_a_worker_process(tiny_model_dir):
    env = dict(os.environ, QWEN_TRT_WORKER="process", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run([sys.executable, "-m", "qwen_trt", "chat", "--model", str(tiny_model_dir),
                        "--backend", "torch", "--prompt", "你好 🚀", "--json",
                        "--temperature", "0", "--max-new-tokens", "7"],
                       capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout)
    assert out["tokens"] == 7 and out["finish_reason"] == "length"
    assert "[qwen-trt engine] ready in" in r.stderr


def test_app_runs_the_engine_in_a_worker_process(tiny_model_dir, monkeypatch):
    """The default (process) mode under Streamlit, whose script runner makes app.py the
    ``__main__`` module: the worker must not re-run it (multiprocessing's spawn would)."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("QWEN_TRT_WORKER", "process")
    monkeypatch.setattr(sys, "argv", ["app.py", "--model", str(tiny_model_dir),
                                      "--backend", "torch", "--device", "cpu"])
    st.cache_resource.clear()
    try:
        at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "app.py"),
                               default_timeout=TIMEOUT).run()
        assert not at.exception, [e.value for e in at.exception]
        at.sidebar.slider(key="max_new_tokens").set_value(128).run()
        at.chat_input[0].set_value("hi").run()
        assert not at.exception, [e.value for e in at.exception]
        messages = at.session_state["chat_state"].chat.messages
        assert [m.role for m in messages] == ["user", "assistant"] and messages[1].content
        engine = service_mod._current
        assert isinstance(engine, WorkerClient) and engine.pid != os.getpid()
        assert engine.status().served == 1
    finally:
        st.cache_resource.clear()                  # on_release closes the engine process
    assert service_mod._current.closed
