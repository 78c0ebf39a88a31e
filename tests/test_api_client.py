"""The ``openai`` backend (qwen_trt.serving.remote): against ``qwen-trt serve`` on the
tiny model, and against a stub server that answers the ways other servers do (flat and nested
error bodies, an error event inside the stream, a stream cut without a finish)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

pytest.importorskip("openai")
from fastapi import FastAPI  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from qwen_trt.serving.remote import (EstimatingTokenizer, OpenAIConfig,  # noqa: E402
                                     OpenAIService, RemoteServerError, http_error_line)
from qwen_trt.serving.session import ChatSession  # noqa: E402
from qwen_trt.errors import BackendUnavailableError, ConfigError  # noqa: E402
from qwen_trt.params import SamplingParams  # noqa: E402
from qwen_trt.serving.events import Delta, Failed, Finished  # noqa: E402
from servers import app_in_thread, free_port, start_serve  # noqa: E402

KEY = "client-key"
CTX = 512
GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_serve(tiny_model_dir, tmp_path_factory.mktemp("serve"), "--api-key", KEY,
                    "--max-seq-len", str(CTX))
    yield s
    s.stop()


def drain(handle, timeout=60):
    texts, last = [], None
    deadline = time.monotonic() + timeout
    for ev in handle.events(poll_s=0.05):
        if isinstance(ev, Delta):
            texts.append(ev.text)
        if isinstance(ev, (Finished, Failed)):
            last = ev
        assert time.monotonic() < deadline
    return "".join(texts), last


def test_chat_through_qwen_trt_serve_matches_the_server(server, tiny_model_dir):
    svc = OpenAIService(OpenAIConfig(f"{server.url}/v1", api_key=KEY))
    try:
        assert svc.info.max_seq_len == CTX and svc.info.name == "openai"
        assert svc.model == str(tiny_model_dir) and svc.exact_tokens
        chat = ChatSession(svc.tokenizer, system_prompt="be brief")
        plan = chat.prepare("Hello there", max_input_len=svc.info.max_input_len,
                            max_seq_len=svc.info.max_seq_len, max_new_tokens=12)
        assert plan.messages[0] == {"role": "system", "content": "be brief"}
        text, fin = drain(svc.submit_plan(plan, GREEDY))
        assert isinstance(fin, Finished), fin
        direct = httpx.post(f"{server.url}/v1/chat/completions", headers={
            "Authorization": f"Bearer {KEY}"}, json={"messages": plan.messages, "max_tokens": 12,
                                                      "temperature": 0}, timeout=30).json()
        assert text == fin.reply.text == direct["choices"][0]["message"]["content"]
        m = fin.reply.metrics
        assert m.prompt_tokens == len(plan.ids) == direct["usage"]["prompt_tokens"]
        assert m.tokens == direct["usage"]["completion_tokens"]
        assert m.finish_reason == direct["choices"][0]["finish_reason"]
    finally:
        svc.close()


def test_without_a_local_tokenizer_counts_are_estimated_then_calibrated(server, tmp_path):
    svc = OpenAIService(OpenAIConfig(server.url, api_key=KEY, tokenizer=str(tmp_path / "none")))
    try:
        assert svc.cfg.v1.endswith("/v1") and not svc.exact_tokens
        assert isinstance(svc.tokenizer, EstimatingTokenizer)
        before = svc.tokenizer.bytes_per_token
        chat = ChatSession(svc.tokenizer)
        plan = chat.prepare("Hello " * 20, max_input_len=svc.info.max_input_len,
                            max_seq_len=CTX, max_new_tokens=8)
        _, fin = drain(svc.submit(plan.messages, SamplingParams(max_new_tokens=8, temperature=0)))
        assert isinstance(fin, Finished)
        assert svc.tokenizer.bytes_per_token != before     # learned from the server's usage
        est = len(svc.tokenizer.encode(svc._render(plan.messages)))
        assert est >= fin.reply.metrics.prompt_tokens        # errs on the long side
    finally:
        svc.close()


def test_cancel_closes_the_stream_and_the_server_drops_the_request(server):
    svc = OpenAIService(OpenAIConfig(server.url, api_key=KEY))
    try:
        h = svc.submit([{"role": "user", "content": "go"}],
                       SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True))
        for ev in h.events(poll_s=0.05):
            if isinstance(ev, Delta):
                break
        h.cancel()
        assert h.wait(10) and h.result().metrics.finish_reason == "cancelled"
        text = ""
        for _ in range(100):
            text = httpx.get(f"{server.url}/metrics").text
            if 'qwen_trt_requests_total{outcome="cancelled"} 1.0' in text:
                break
            time.sleep(0.1)
        assert 'qwen_trt_requests_total{outcome="cancelled"} 1.0' in text
    finally:
        svc.close()


def test_wrong_key_unreachable_server_and_unknown_model_are_one_line(server):
    with pytest.raises(BackendUnavailableError, match="refused the API key") as e:
        OpenAIService(OpenAIConfig(server.url, api_key="wrong"))
    assert "\n" not in str(e.value)
    with pytest.raises(BackendUnavailableError, match="Cannot reach"):
        OpenAIService(OpenAIConfig(f"http://127.0.0.1:{free_port()}/v1", connect_timeout_s=2))
    with pytest.raises(ConfigError, match="does not serve 'nope'"):
        OpenAIService(OpenAIConfig(server.url, api_key=KEY, model="nope"))
    with pytest.raises(ConfigError, match="--base-url"):
        OpenAIConfig("localhost:8000")


@pytest.mark.parametrize("body, expect", [
    ('{"error": {"message": "bad thing", "type": "BadRequestError", "code": 400}}', "bad thing"),
    ('{"object": "error", "message": "flat thing", "type": "BadRequestError", "code": 400}',
     "flat thing"),
    ('{"detail": "detail thing"}', "detail thing"),
    ('{"error": "string thing"}', "string thing"),
    ("<html>\n<b>502 Bad Gateway</b>\n</html>", "<html> <b>502 Bad Gateway</b> </html>"),
])
def test_error_bodies_become_one_line(body, expect):
    line = http_error_line(400, body, "http://x/v1")
    assert expect in line and "\n" not in line


# -- a stub server behaving like other servers ----------------------------------------------------
MODE = {"value": "ok"}


def _stub_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    @app.post("/v1/chat/completions")
    def chat():
        mode = MODE["value"]
        if mode == "flat400":
            return JSONResponse({"object": "error", "message": "This model's maximum context "
                                 "length is 64 tokens.", "type": "BadRequestError", "code": 400},
                                status_code=400)

        def gen():
            for word in ("part", "ial "):
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": word},
                                                          "finish_reason": None}]}) + "\n\n"
            if mode == "error_event":
                yield 'data: {"error": {"message": "engine overloaded", "code": 500}}\n\n'
                yield "data: [DONE]\n\n"
            elif mode == "cut":
                return
            else:
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {},
                                                          "finish_reason": "stop"}]}) + "\n\n"
                yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def stub():
    with app_in_thread(_stub_app()) as origin:
        yield f"{origin}/v1"


def test_stub_needs_the_context_flag_then_streams(stub):
    with pytest.raises(ConfigError, match="--max-seq-len"):
        OpenAIService(OpenAIConfig(stub))
    svc = OpenAIService(OpenAIConfig(stub, max_seq_len=64))
    try:
        MODE["value"] = "ok"
        text, fin = drain(svc.submit([{"role": "user", "content": "x"}], GREEDY))
        assert text == "partial " and isinstance(fin, Finished)
        assert fin.reply.metrics.finish_reason == "stop" and fin.reply.metrics.tokens == 2
    finally:
        svc.close()


@pytest.mark.parametrize("mode, expect", [
    ("flat400", "answered 400: This model's maximum context length is 64 tokens."),
    ("error_event", "reported an error mid-reply: engine overloaded"),
    ("cut", "went away mid-reply (the stream ended without a finish); the partial reply is kept."),
])
def test_stub_failures_are_one_line_and_keep_the_partial_text(stub, mode, expect):
    svc = OpenAIService(OpenAIConfig(stub, max_seq_len=64))
    try:
        MODE["value"] = mode
        h = svc.submit([{"role": "user", "content": "x"}], GREEDY)
        text, fin = drain(h)
        assert isinstance(fin, Failed) and isinstance(fin.error, RemoteServerError)
        assert expect in str(fin.error) and "\n" not in str(fin.error)
        assert h.text == ("" if mode == "flat400" else "partial ")
    finally:
        MODE["value"] = "ok"
        svc.close()
