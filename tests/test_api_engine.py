"""The API against an in-process engine with a scripted, gated backend (one uvicorn server for
the module, on loopback): queue full, a dropped stream cancels its handle, engine failures,
stop strings over multi-byte text; plus the request checks and the serve command's refusals."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from fakes import ScriptedBackend  # noqa: E402
from qwen_trt.api.errors import ApiError  # noqa: E402
from qwen_trt.api.protocol import parse_chat_request  # noqa: E402
from qwen_trt.api.server import ServerSettings, create_app  # noqa: E402
from qwen_trt.api.stops import StopScanner  # noqa: E402
from qwen_trt.serving.service import InferenceService  # noqa: E402
from servers import app_in_thread, free_port  # noqa: E402

TEXT = "Héllo wörld 你好 END and more"


class Backend(ScriptedBackend):
    fail_after: int | None = None

    def stream(self, prompt_ids, params):
        for i, tid in enumerate(super().stream(prompt_ids, params)):
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("CUDA out of memory (simulated)")
            yield tid


class Recording(InferenceService):
    def __init__(self, backend):
        super().__init__(backend)
        self.handles = []

    def submit(self, prompt_ids, params, dropped_turns=0):
        h = super().submit(prompt_ids, params, dropped_turns)
        self.handles.append(h)
        return h


def wait_until(cond, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture(scope="module")
def env(tiny_tokenizer):
    backend = Backend(tiny_tokenizer, TEXT)
    service = Recording(backend)
    port = free_port()
    app = create_app(service, ServerSettings(port=port, max_queue=1), model_name="fake")
    with app_in_thread(app, port) as origin:
        client = openai.OpenAI(base_url=f"{origin}/v1", api_key="x", max_retries=0, timeout=30)
        yield backend, service, client, origin
        backend.gate.set()
    service.close()


@pytest.fixture
def gated(env):
    backend, service, client, url = env
    backend.gate.clear()
    backend.fail_after = None
    yield env
    backend.gate.set()
    assert wait_until(lambda: not service.status().busy and service.status().queued == 0)


def ask(text="hi"):
    return [{"role": "user", "content": text}]


def test_stop_string_over_multibyte_deltas(env):
    _, _, client, _ = env
    r = client.chat.completions.create(model="fake", messages=ask(), stop=["END", "zzz"])
    assert r.choices[0].message.content == "Héllo wörld 你好 "
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="fake", messages=ask(), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == TEXT


def test_dropped_stream_cancels_handle_and_frees_engine(gated):
    backend, service, client, _ = gated
    stream = client.chat.completions.create(model="fake", messages=ask(), stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    handle = service.handles[-1]
    assert wait_until(lambda: service.status().busy)
    stream.close()
    assert wait_until(lambda: handle.cancelled and handle.done, 10)
    assert handle.result().metrics.finish_reason == "cancelled"
    assert wait_until(lambda: not service.status().busy)
    backend.gate.set()
    r = client.chat.completions.create(model="fake", messages=ask())
    assert r.choices[0].message.content == TEXT


def test_queue_full_is_503_with_retry_after_and_queued_client_leaving_cancels(gated):
    backend, service, client, url = gated
    running = client.chat.completions.create(model="fake", messages=ask(), stream=True)
    next(iter(running))
    assert wait_until(lambda: service.status().busy)
    # a second request waits in the queue (max_queue=1); its client gives up after 1 s
    waiter = threading.Thread(target=lambda: pytest.raises(
        httpx.ReadTimeout, httpx.post, f"{url}/v1/chat/completions", json={"messages": ask()},
        timeout=httpx.Timeout(10, read=1.0)))
    waiter.start()
    assert wait_until(lambda: service.status().queued == 1)
    queued = service.handles[-1]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ask()}, timeout=10)
    assert r.status_code == 503
    assert r.headers["retry-after"].isdigit()
    assert r.json()["error"]["code"] == "queue_full"
    waiter.join(15)
    assert wait_until(lambda: queued.cancelled and queued.done and service.status().queued == 0)
    backend.gate.set()
    text = "".join(c.choices[0].delta.content or "" for c in running if c.choices)
    assert text == TEXT


def test_engine_failure_mid_stream_is_one_error_event(env):
    backend, _, client, _ = env
    backend.fail_after = 3
    try:
        with pytest.raises(openai.APIError, match="simulated"):
            for _ in client.chat.completions.create(model="fake", messages=ask(), stream=True):
                pass
        with pytest.raises(openai.InternalServerError, match="simulated"):
            client.chat.completions.create(model="fake", messages=ask())
    finally:
        backend.fail_after = None
    assert client.chat.completions.create(model="fake", messages=ask()).choices[0].message.content


def test_health_is_503_when_the_engine_is_gone(tiny_tokenizer):
    from fastapi.testclient import TestClient

    service = InferenceService(Backend(tiny_tokenizer, "x"))
    app = create_app(service, model_name="fake")
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        service.close()
        r = c.get("/health")
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"messages": ask()})
        assert r.status_code == 503 and "retry-after" in r.headers


def test_penalties_map_when_the_engine_has_them_else_400():
    req = parse_chat_request({"messages": ask(), "presence_penalty": 0.5, "repetition_penalty": 1.1},
                             penalties={"presence_penalty", "repetition_penalty"})
    assert req.penalties == {"presence_penalty": 0.5, "repetition_penalty": 1.1}
    with pytest.raises(ApiError, match="frequency_penalty"):
        parse_chat_request({"messages": ask(), "frequency_penalty": 1}, penalties=set())
    req = parse_chat_request({"messages": ask(), "frequency_penalty": 0, "repetition_penalty": 1},
                             penalties=set())
    assert req.penalties == {}


def test_request_parsing_details():
    req = parse_chat_request({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}, {"role": "user", "content": "c"}],
        "max_completion_tokens": 5, "max_tokens": 9, "top_k": -1, "stop": "x",
        "stream_options": {"include_usage": True}})
    assert req.messages[0] == {"role": "system", "content": "be brief"}
    assert req.messages[1]["content"] == "a\nb" and req.messages[2]["content"] == ""
    assert req.max_tokens == 5 and req.top_k == 0 and req.stop == ("x",)
    assert req.include_usage is False   # only with stream: true


def test_stop_scanner_holds_back_partial_matches():
    s = StopScanner(["STOP"])
    out = [s.feed(d) for d in ["ab", "cS", "T", "x", "yST", "OP tail"]]
    assert "".join(out) == "abcSTxy" and s.stopped and s.text == "abcSTxy"
    s = StopScanner([])
    assert s.feed("abc") == "abc" and s.flush() == ""


def test_serve_refuses_a_public_host_without_a_key(capsys, monkeypatch):
    from qwen_trt.cli import main

    monkeypatch.delenv("QWEN_TRT_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Refusing to listen on 0.0.0.0 without a key" in err[0]
    assert main(["serve", "--port", "http", "--model", "/nonexistent"]) == 2
    assert "--port must be a whole number" in capsys.readouterr().err


def test_http_overhead_bench_measures_both_paths(tiny_model_dir, tmp_path):
    import json

    from qwen_trt.bench.http_overhead import main

    out = tmp_path / "o.json"
    assert main(["--model", str(tiny_model_dir), "--device", "cpu", "--requests", "2",
                 "--input-words", "5", "--output-tokens", "4", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["in_process_ttft_ms_p50"] > 0 and res["http_ttft_ms_p50"] > 0
    assert res["http_total_ms_p50"] >= res["http_ttft_ms_p50"]


def test_whole_reply_client_leaving_while_running_cancels(gated):
    backend, service, client, url = gated
    t = threading.Thread(target=lambda: pytest.raises(
        httpx.ReadTimeout, httpx.post, f"{url}/v1/chat/completions", json={"messages": ask()},
        timeout=httpx.Timeout(10, read=1.0)))
    t.start()
    assert wait_until(lambda: service.status().busy)
    handle = service.handles[-1]
    t.join(15)
    assert wait_until(lambda: handle.cancelled and handle.done, 10)
    assert wait_until(lambda: not service.status().busy)


def test_penalties_reach_the_engine(env):
    _, service, client, _ = env
    client.chat.completions.create(model="fake", messages=ask(), presence_penalty=0.5,
                                   frequency_penalty=-0.5, top_p=0,
                                   extra_body={"repetition_penalty": 1.2, "min_p": 0.1,
                                               "stop_token_ids": [7, 7, 9]})
    p = service.handles[-1].params
    assert (p.presence_penalty, p.repetition_penalty, p.frequency_penalty) == (0.5, 1.2, -0.5)
    assert (p.top_p, p.min_p, p.stop_token_ids, p.logprobs, p.grammar) == (0, 0.1, (7, 9),
                                                                           None, None)


def test_metrics_read_whatever_the_service_status_reports():
    from dataclasses import dataclass, field

    from qwen_trt.api.metrics import ServerMetrics

    @dataclass
    class Status:       # the engine-process client's shape
        busy: bool = True
        queued: int = 3
        running: int = 2
        cached_tokens: int = 30
        prompt_tokens: int = 120
        restarts: int = 1
        runner: dict = field(default_factory=lambda: {"kv_blocks_used": 5, "kv_blocks_total": 20})

    text = ServerMetrics(Status, lambda: 1, lambda: 2).render().decode()
    for line in ("qwen_trt_engine_queue_depth 3.0", "qwen_trt_engine_running 2.0",
                 "qwen_trt_kv_cache_usage_ratio 0.25", "qwen_trt_prefix_cache_hit_ratio 0.25",
                 "qwen_trt_engine_restarts 1.0", "qwen_trt_requests_waiting 1.0"):
        assert line in text, line


def test_health_follows_the_engine_state():
    from types import SimpleNamespace

    from qwen_trt.api.server import engine_alive
    from qwen_trt.serving.events import ServiceStatus

    for state, ok in (("ready", True), ("loading", False), ("restarting", False),
                      ("stopped", False), ("failed", False), ("closed", False)):
        svc = SimpleNamespace(status=lambda s=state: ServiceStatus(busy=False, queued=0,
                                                                   served=0, state=s))
        assert engine_alive(svc) is ok, state
