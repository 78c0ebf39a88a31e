"""The app and ``qwen-trt chat`` with ``--backend openai`` against ``qwen-trt serve`` on the tiny
model (AppTest, as tests/test_app.py), and against a stub server that cuts its stream."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
import streamlit as st
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from streamlit.testing.v1 import AppTest

from servers import app_in_thread, start_serve

APP = str(Path(__file__).resolve().parents[1] / "app.py")
KEY = "app-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_serve(tiny_model_dir, tmp_path_factory.mktemp("serve"), "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def fresh_cache():
    st.cache_resource.clear()
    yield
    st.cache_resource.clear()


def app_with(monkeypatch, *argv: str) -> AppTest:
    monkeypatch.setattr(sys, "argv", ["app.py", *argv])
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def direct(server, messages, max_tokens):
    return httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"messages": messages, "max_tokens": max_tokens, "temperature": 0},
                      timeout=60).json()["choices"][0]["message"]["content"]


def test_app_streams_from_qwen_trt_serve(server, tiny_model_dir, monkeypatch):
    at = app_with(monkeypatch, "--backend", "openai", "--base-url", f"{server.url}/v1",
                  "--api-key", KEY)
    info = " ".join(c.value for c in at.sidebar.caption)
    assert f"openai · {tiny_model_dir} @ {server.url}/v1 · remote" in info
    at.sidebar.slider(key="max_new_tokens").set_value(128).run()
    at.sidebar.slider(key="temperature").set_value(0.0).run()
    at.chat_input[0].set_value("hello there").run()
    assert not at.exception and not at.error
    msgs = at.session_state["chat_state"].chat.messages
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[1].content == direct(server, [{"role": "user", "content": "hello there"}], 128)
    at.chat_input[0].set_value("and more").run()   # the history goes to the server as messages
    msgs = at.session_state["chat_state"].chat.messages
    history = [{"role": m.role, "content": m.content} for m in msgs[:3]]
    assert msgs[3].content == direct(server, history, 128)


def test_app_without_base_url_or_with_a_wrong_key_says_one_line(server, monkeypatch):
    at = app_with(monkeypatch, "--backend", "openai")
    assert "--base-url" in at.error[0].value and "\n" not in at.error[0].value.strip()
    st.cache_resource.clear()
    at = app_with(monkeypatch, "--backend", "openai", "--base-url", server.url, "--api-key", "no")
    assert "refused the API key" in at.error[0].value


def test_chat_cli_over_openai_backend(server, capsys):
    from qwen_trt.cli import main

    rc = main(["chat", "--backend", "openai", "--base-url", f"{server.url}/v1", "--api-key", KEY,
               "--prompt", "hi there", "--json", "--temperature", "0", "--max-new-tokens", "16"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["text"] == direct(server, [{"role": "user", "content": "hi there"}], 16)
    assert out["finish_reason"] in ("stop", "length") and out["prompt_tokens"] > 0


# -- a server that dies mid-reply ------------------------------------------------------------------
@pytest.fixture(scope="module")
def cutting_server():
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model", "max_model_len": 4096}]}

    @app.post("/v1/chat/completions")
    def chat():
        def gen():
            for word in ("Partial ", "answer"):
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": word},
                                                          "finish_reason": None}]}) + "\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    with app_in_thread(app) as origin:
        yield f"{origin}/v1"


def test_app_keeps_partial_text_when_the_server_goes_away(cutting_server, monkeypatch):
    at = app_with(monkeypatch, "--backend", "openai", "--base-url", cutting_server)
    at.chat_input[0].set_value("hi").run()
    assert not at.exception
    assert len(at.error) == 1 and "went away mid-reply" in at.error[0].value
    msgs = at.session_state["chat_state"].chat.messages
    assert [(m.role, m.content) for m in msgs] == [("user", "hi"), ("assistant", "Partial answer")]
    assert msgs[1].interrupted


def test_chat_cli_says_one_line_when_the_server_goes_away(cutting_server, capsys):
    from qwen_trt.cli import main

    assert main(["chat", "--backend", "openai", "--base-url", cutting_server, "--prompt", "x"]) == 2
    cap = capsys.readouterr()
    assert cap.out.startswith("Partial answer")
    err = [ln for ln in cap.err.strip().splitlines() if ln != "loading model..."]
    assert len(err) == 1 and "went away mid-reply" in err[0] and "partial reply is kept" in err[0]


def test_options_for_the_openai_backend():
    from qwen_trt.errors import ConfigError
    from qwen_trt.options import app_parser, config_from

    def parse(argv, env):
        return config_from(app_parser().parse_args(argv), env)

    cfg = parse(["--backend", "openai", "--base-url", "http://h:1/v1"], {"QWEN_TRT_API_KEY": "k"})
    assert (cfg.backend, cfg.base_url, cfg.api_key) == ("openai", "http://h:1/v1", "k")
    with pytest.raises(ConfigError, match="needs --base-url / QWEN_TRT_BASE_URL"):
        parse(["--backend", "openai"], {})
