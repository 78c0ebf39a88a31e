"""A replica heals itself: the engine process that dies is started again with no request needed
(a readiness probe that stopped sending traffic sees ``/health`` come back), with backoff while
starts keep failing; queued requests wait through a crash during the restart's own load; and
``qwen-trt serve`` answers ``/health`` (503 with a reason) from the moment its port is bound,
while the model first loads too.

The faults come from ``serving_fakes.load_echo_gated`` (a load that waits for a file, a load
that crashes), named through ``QWEN_TRT_TEST_LOADER`` for the served case."""
from __future__ import annotations

import io
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from servers import start_serve, wait_for
from test_api_shutdown import children

from qwen_trt.api.health import health_of
from qwen_trt.backends import BackendConfig
from qwen_trt.params import SamplingParams
from qwen_trt.serving.client import WorkerClient
from qwen_trt.serving.events import EngineCrashingError, WorkerStoppedError
from qwen_trt.serving.liveness import RestartPolicy
from qwen_trt.serving.worker import WorkerSpec

TIMEOUT = 120      # only a hang reaches it
LONG = SamplingParams(max_new_tokens=4000, temperature=0, ignore_eos=True)   # until it dies
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The crash-count file the fake loader reads (in this process's environment, which each
    engine process inherits)."""
    path = tmp_path_factory.mktemp("faults") / "crashes"
    path.write_text("0")
    os.environ["SERVING_FAKES_CRASHES"] = str(path)
    yield path
    os.environ.pop("SERVING_FAKES_CRASHES", None)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, faults):
    """The echo fake, one request at a time, restarts after 0.3 s, 0.6 s, ...; queued requests
    wait through 2 deaths in a row."""
    client = WorkerClient(WorkerSpec(BackendConfig(model=str(tiny_model_dir)),
                                     loader="serving_fakes:load_echo_gated"),
                          echo=io.StringIO(),
                          restart=RestartPolicy(backoff_s=0.3, backoff_max_s=1.0, keep=2))
    yield client
    client.close()


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _short(tok, text: str) -> SamplingParams:
    return SamplingParams(max_new_tokens=len(_ids(tok, text)) + 1, temperature=0)


def _streaming(engine, tok):
    """A request whose reply has begun (it fails when the engine dies: one error line)."""
    h = engine.submit(_ids(tok, "run"), LONG)
    assert wait_for(lambda: bool(h.text), TIMEOUT)
    return h


def _until_ready(engine) -> None:
    assert wait_for(lambda: engine.status().state == "ready", TIMEOUT), engine.status()


def test_a_crash_during_the_restarts_load_keeps_the_queued_requests(engine, faults,
                                                                    tiny_tokenizer):
    _until_ready(engine)
    time.sleep(1.1)                   # up longer than backoff_max_s: this death is a first
    restarts = engine.status().restarts
    running = _streaming(engine, tiny_tokenizer)
    texts = ["still here", "and me too"]
    queued = [engine.submit(_ids(tiny_tokenizer, t), _short(tiny_tokenizer, t)) for t in texts]
    assert [h.state for h in queued] == ["queued", "queued"]
    faults.write_text("1")            # the restart's load dies
    os.kill(engine.pid, signal.SIGKILL)

    assert running.wait(TIMEOUT)
    with pytest.raises(WorkerStoppedError, match="killed by SIGKILL"):
        running.result(0)             # its reply had begun: one error line, as before
    for h, text in zip(queued, texts):
        assert h.result(TIMEOUT).text == text      # waited through the crash, then ran
    assert faults.read_text() == "0"               # the crash did happen
    st = engine.status()
    assert st.state == "ready" and st.restarts == restarts + 2 and st.reason == ""


def test_starts_that_keep_failing_back_off_refuse_clearly_and_recover(engine, faults,
                                                                      tiny_tokenizer):
    _until_ready(engine)
    time.sleep(1.1)
    restarts = engine.status().restarts
    running = _streaming(engine, tiny_tokenizer)
    waiting = [engine.submit(_ids(tiny_tokenizer, "queued"), _short(tiny_tokenizer, "queued"))
               for _ in range(2)]
    faults.write_text("2")            # two loads in a row die: 3 deaths, more than keep=2
    os.kill(engine.pid, signal.SIGKILL)
    assert running.wait(TIMEOUT)

    seen: list = []

    def crashing_with_a_wait() -> bool:
        st = engine.status()
        seen.append(st)
        return st.state == "crashing" and st.next_retry_s is not None and st.next_retry_s > 0
    assert wait_for(crashing_with_a_wait, TIMEOUT), seen[-3:]
    code, body = health_of(engine)
    assert code == 503 and body["status"] == "crashing" and body["restarts"] > restarts
    assert "exit code 3" in body["reason"] and body["next_retry_s"] >= 0, body
    assert "not running (crashing: " in body["error"]["message"]

    # the queued ones waited through two deaths, and are refused at the third (retryable)
    for h in waiting:
        assert h.wait(TIMEOUT)
        with pytest.raises(EngineCrashingError, match=r"keeps stopping as it starts \(3 times "
                                                      r"in a row; last: it stopped while "
                                                      r"starting again \(exit code 3\)\)"):
            h.result(0)
    if engine.status().state != "ready":          # and so is a new one, until a start works
        with pytest.raises(EngineCrashingError):
            engine.submit(_ids(tiny_tokenizer, "new"), _short(tiny_tokenizer, "new"))
    _until_ready(engine)              # back by itself, no request needed
    st = engine.status()
    assert st.restarts == restarts + 3 and st.next_retry_s is None and faults.read_text() == "0"
    ok = engine.submit(_ids(tiny_tokenizer, "fine"), _short(tiny_tokenizer, "fine"))
    assert ok.result(TIMEOUT).text == "fine"


# -- qwen-trt serve: /health from the moment the port is bound ----------------------------------
def _health(url: str):
    try:
        r = httpx.get(f"{url}/health", timeout=5)
    except httpx.TransportError:
        return None
    return r.status_code, r.json()


def test_serve_answers_health_while_loading_and_comes_back_without_traffic(tiny_model_dir,
                                                                           tmp_path):
    go = tmp_path / "go"              # the fake load waits for this file
    env = {"QWEN_TRT_WORKER": "process", "PYTHONUNBUFFERED": "1",
           "QWEN_TRT_TEST_LOADER": "serving_fakes:load_echo_gated",
           "SERVING_FAKES_GO": str(go),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    served = start_serve(tiny_model_dir, tmp_path, env=env, wait=False)
    try:
        # 1. the first load: the port answers before the model is there
        first: list = []
        assert wait_for(lambda: first.append(_health(served.url)) or first[-1] is not None,
                        TIMEOUT), served.log_tail()
        code, body = first[-1]
        assert code == 503 and body["status"] == "loading" and body["reason"], body
        r = httpx.post(f"{served.url}/v1/chat/completions", timeout=5,
                       json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "not ready yet (loading" in r.json()["error"]["message"]
        go.write_text("")
        assert wait_for(lambda: (_health(served.url) or (0,))[0] == 200, TIMEOUT), \
            served.log_tail()
        assert _health(served.url)[1] == {"status": "ready", "restarts": 0}

        # 2. the worker dies with no traffic: /health polled only, it comes back by itself
        go.unlink()                   # the restart's load waits: its 503 is seen for sure
        (worker,) = children(served.proc.pid)
        os.kill(worker, signal.SIGKILL)
        states: list = []
        assert wait_for(lambda: states.append(_health(served.url))
                        or (states[-1] or (0, {}))[1].get("status") == "restarting", TIMEOUT)
        assert states[-1][0] == 503 and "killed by SIGKILL" in states[-1][1]["reason"]
        go.write_text("")
        assert wait_for(lambda: (_health(served.url) or (0,))[0] == 200, TIMEOUT), \
            served.log_tail()
        assert _health(served.url)[1]["restarts"] == 1
        assert children(served.proc.pid) != [worker]
        r = httpx.post(f"{served.url}/v1/chat/completions", timeout=TIMEOUT,
                       json={"messages": [{"role": "user", "content": "hello"}],
                             "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]

    finally:
        served.stop()
    assert "Traceback" not in served.log.read_text(errors="replace"), served.log_tail(40)
