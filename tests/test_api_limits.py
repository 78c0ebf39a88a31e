"""What one client can do to ``qwen-trt serve``, against the app in a thread with an in-process
fake engine: odd JSON never gives a 5xx, bodies over the limit get 413, ``--max-queue`` holds
for streams, /health answers while a 10 MB prompt is tokenised, prompts that cannot fit are
refused before tokenising, slow clients get 408, and ``--host`` / ``--api-key`` are checked
before the model loads."""
from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import ScriptedBackend
from qwen_trt.api.limits import chars_per_token, min_prompt_tokens
from qwen_trt.api.server import ServerSettings, create_app
from qwen_trt.api.shutdown import uvicorn_config
from qwen_trt.serving.service import InferenceService
from servers import app_in_thread, free_port, wait_for

TEXT = "ok fine"


class EngineLike(ScriptedBackend):
    """Takes the sampling values the way the real engine does (int64 tensors, a seeded
    generator), so a value the API lets through but the engine cannot hold fails here too."""

    def stream(self, prompt_ids, params):
        import torch

        torch.tensor([params.top_k, params.max_new_tokens], dtype=torch.long)
        if params.seed is not None:
            torch.Generator().manual_seed(params.seed)
        yield from super().stream(prompt_ids, params)


@contextlib.contextmanager
def serving(tokenizer, *, max_seq_len=4096, backend_cls=EngineLike, **kw):
    backend = backend_cls(tokenizer, TEXT, max_seq_len=max_seq_len)
    service = InferenceService(backend)
    s = ServerSettings(port=free_port(), **kw)
    app = create_app(service, s, model_name="fake")
    try:
        with app_in_thread(app, config=uvicorn_config(app, s, log_level="warning")) as origin:
            yield origin, backend, service
    finally:
        backend.gate.set()
        service.close()


@pytest.fixture(scope="module")
def server(tiny_tokenizer):
    with serving(tiny_tokenizer, max_body_mb=1) as env:
        yield env


def chat(origin: str, body, timeout=30) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{origin}/v1/chat/completions", content=raw, timeout=timeout,
                      headers={"content-type": "application/json"})


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "\n" not in err["message"] and len(err["message"]) <= 500
    return err


# -- no JSON body gives a 500 -------------------------------------------------------------------
HUGE = 2**64 + 5


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": {"a": 1}, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_k": 2**63}, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": HUGE}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 10**400}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "seed"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "\ud800x"}, "model"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": "x" * 10_000}, "n"),
    ({"messages": [{"role": "x" * 10_000, "content": "hi"}]}, "messages[0].role"),
])
def test_odd_values_are_400_with_a_short_excerpt(server, body, param):
    err = assert_openai_error(chat(server[0], body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000,
                                 b"\xff\xfe{}", b"", b"{\"messages\": NaN}"])
def test_bodies_that_are_not_json_or_too_deep_are_400(server, raw):
    assert_openai_error(chat(server[0], raw), 400)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
    | st.sampled_from(["\ud800", "a\udfffb", "user", "assistant", "system", "tool", "text"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]) | json_values},
    optional={"content": st.text(max_size=30) | json_values
              | st.lists(st.fixed_dictionaries({"type": st.just("text") | json_values,
                                                "text": st.text(max_size=10) | json_values}),
                         max_size=3),
              "tool_calls": json_values, "name": json_values})
FIELDS = ["model", "stream", "stream_options", "max_tokens", "max_completion_tokens",
          "temperature", "top_p", "top_k", "seed", "stop", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "n", "logprobs", "tools", "tool_choice",
          "response_format", "ignore_eos", "user", "min_p", "logit_bias"]
plausible = {"stream": st.booleans(), "max_tokens": st.integers(-3, 2**65),
             "top_k": st.integers(-3, 2**65), "seed": st.integers(-3, 2**65),
             "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
             "stop": st.lists(st.text(max_size=5), max_size=3) | st.text(max_size=5),
             "stream_options": st.fixed_dictionaries({"include_usage": json_values})}
body = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=3) | json_values},
    optional={f: plausible.get(f, json_values) | json_values for f in FIELDS}) | json_values


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=body)
def test_random_json_bodies_never_give_a_5xx(server, body):
    origin = server[0]
    raw = json.dumps(body).encode()       # NaN / Infinity and \ud800 escapes: what clients send
    with httpx.stream("POST", f"{origin}/v1/chat/completions", content=raw, timeout=30,
                      headers={"content-type": "application/json"}) as r:
        text = r.read().decode()
    assert r.status_code < 500, text[:300]
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert not any('"server_error"' in e for e in events), text[:300]
    elif r.status_code != 200:
        assert_openai_error(r, r.status_code)


# -- the body limit -----------------------------------------------------------------------------
def test_a_body_over_the_limit_is_413_declared_or_chunked(server):
    origin = server[0]
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (1024 * 1024 + 10)}]})
    err = assert_openai_error(chat(origin, big.encode()), 413)
    assert err["code"] == "request_too_large" and "1 MiB" in err["message"]

    def chunks():                        # no Content-Length: Transfer-Encoding: chunked
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}]}'

    r = httpx.post(f"{origin}/v1/chat/completions", content=chunks(), timeout=30)
    assert "content-length" not in r.request.headers
    assert assert_openai_error(r, 413)["code"] == "request_too_large"
    small = chat(origin, {"messages": [{"role": "user", "content": "z" * 500_000}],
                          "max_tokens": 2})
    assert small.status_code in (200, 400)      # read whole; 400 only for the context


# -- prompts that cannot fit --------------------------------------------------------------------
def test_a_prompt_that_cannot_fit_is_refused_before_tokenising(server, monkeypatch):
    import qwen_trt.api.encoder as enc       # the server's PromptEncoder encodes through it

    calls = []
    real = enc.encode_messages
    monkeypatch.setattr(enc, "encode_messages", lambda *a, **k: calls.append(1) or real(*a, **k))
    origin = server[0]
    r = chat(origin, {"messages": [{"role": "user", "content": "word " * 180_000}]})
    err = assert_openai_error(r, 400)
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
    assert calls == []
    # one that passes the bound but not the count: the exact number, as OpenAI says it
    messages = [{"role": "user", "content": "word " * 8000}]
    r = chat(origin, {"messages": messages})
    err = assert_openai_error(r, 400)
    assert err["code"] == "context_length_exceeded" and "at least" not in err["message"]
    n = int(err["message"].split("resulted in ")[1].split()[0])
    assert n == len(real(server[2].tokenizer, messages)) > 4096
    assert calls == [1]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.lists(st.characters(codec="utf-8") | st.sampled_from(
    ["\u1100\u1161\u11a8", "\u0391\u0313\u0342\u0345", " " * 40, "=" * 50, "\ud800", "e\u0301",
     "\U0001d400"]), max_size=120).map("".join))
def test_the_cheap_bound_never_exceeds_the_real_count(tiny_tokenizer, text):
    from qwen_trt.serving.session import encode_messages

    per = chars_per_token(tiny_tokenizer)
    assert per is not None and per >= 4
    messages = [{"role": "user", "content": text}]
    assert min_prompt_tokens(messages, per) <= len(encode_messages(tiny_tokenizer, messages))


def test_no_bound_for_a_tokenizer_that_can_drop_text(tiny_tokenizer):
    from tokenizers import Tokenizer, normalizers

    backend = Tokenizer.from_str(tiny_tokenizer.backend_tokenizer.to_str())
    backend.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])

    class Tok:
        backend_tokenizer = backend

    assert chars_per_token(Tok()) is None
    assert min_prompt_tokens([{"role": "user", "content": " " * 10**6}], None) == 0


# -- the queue holds for streams ----------------------------------------------------------------
def _read_until(sock: socket.socket, marker: bytes, limit_s: float = 60) -> bytes:
    got, deadline = b"", time.monotonic() + limit_s
    while marker not in got and time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        if not chunk:
            break
        got += chunk
    return got


def test_max_queue_holds_for_concurrent_streams(tiny_tokenizer):
    with serving(tiny_tokenizer, max_queue=2) as (origin, backend, service):
        backend.gate.clear()             # the engine takes one request and makes no progress
        port = int(origin.rsplit(":", 1)[1])
        n = 40
        socks = [socket.create_connection(("127.0.0.1", port), timeout=1) for _ in range(n)]
        try:
            for i, sock in enumerate(socks):     # all at once, on open connections
                body = json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}],
                                   "stream": True}).encode()
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\nConnection: close\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            heads = [_read_until(sock, b"\r\n\r\n") for sock in socks]
            statuses = [int(h.split(b" ", 2)[1]) if h.startswith(b"HTTP/1.1 ") else -1
                        for h in heads]
            accepted = [i for i in range(n) if statuses[i] == 200]
            refused = [i for i in range(n) if statuses[i] == 503]
            # one running in the engine (at most) + 2 waiting
            assert 2 <= len(accepted) <= 3, statuses
            assert len(refused) == n - len(accepted), statuses
            for i in refused:
                assert b'"queue_full"' in heads[i] + _read_until(socks[i], b"}}")
            backend.gate.set()
            for i in accepted:
                text = (heads[i] + _read_until(socks[i], b"data: [DONE]")).decode()
                events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
                assert events[-1] == "[DONE]"
                assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "")
                               for e in events[:-1]) == TEXT
        finally:
            for sock in socks:
                sock.close()
        assert wait_for(lambda: service.status().queued == 0 and not service.status().busy)


# -- /health while a 10 MB prompt is tokenised --------------------------------------------------
def test_health_answers_while_a_10mb_prompt_is_tokenised(tiny_model_dir, tmp_path):
    """The server in its own process (a stalled event loop or a held GIL there shows here as a
    /health timeout), reporting a context large enough that 10 MB must be tokenised; driven by
    the benchmark's own code (qwen_trt.bench.health_latency)."""
    from qwen_trt.bench.health_latency import measure, start_child, stop_child

    ctx = 5_000_000
    proc, origin = start_child(str(tiny_model_dir), ctx, tmp_path / "server.log")
    try:
        got = measure(origin, 10, poll_s=0.1, health_timeout_s=5)
    finally:
        assert stop_child(proc) == 0
    assert got["status"] == 400
    assert int(got["error"].split("resulted in ")[1].split()[0]) > ctx
    assert got["health_during"]["polls"] >= 3, got   # in flight while /health answered


# -- slow clients -------------------------------------------------------------------------------
def trickle(port: int, first: bytes, drip: bytes, limit_s: float = 20.0) -> bytes:
    """Send ``first``, then one byte of ``drip`` every 0.2 s (nothing when empty); what the
    server sent back before it closed (or before ``limit_s``)."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        if first:
            s.sendall(first)
        s.settimeout(0.2)
        deadline, i = time.monotonic() + limit_s, 0
        while time.monotonic() < deadline:
            if drip:
                with contextlib.suppress(OSError):
                    s.send(drip[i % len(drip):i % len(drip) + 1])
                i += 1
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                break
            if not chunk:
                break
            got += chunk
    return got


@pytest.mark.parametrize("first, drip", [
    (b"", b""),                                                        # connects, says nothing
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a"),   # headers, slowly
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Content-Length: 5000\r\n\r\n{\"messages\": ", b" "),             # the body, slowly
])
def test_slow_clients_get_408_and_are_closed(tiny_tokenizer, first, drip):
    with serving(tiny_tokenizer, header_timeout_s=1, body_timeout_s=1) as (origin, _b, _s):
        port = int(origin.rsplit(":", 1)[1])
        got = trickle(port, first, drip)
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
        err = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
        assert err["code"] == "request_timeout"
        # a client that keeps pace is not affected
        r = chat(origin, {"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == TEXT


# -- --host and --api-key, before the model loads -----------------------------------------------
def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_host_in_brackets_binds_on_loopback(tiny_tokenizer):
    s = ServerSettings(host="[::1]", port=free_port())
    assert s.host == "::1"                  # loopback: no key needed
    service = InferenceService(EngineLike(tiny_tokenizer, TEXT))
    app = create_app(service, s, model_name="fake")
    try:
        with app_in_thread(app, config=uvicorn_config(app, s, log_level="warning")) as origin:
            assert origin.startswith("http://[::1]:")
            assert httpx.get(f"{origin}/health", timeout=10).status_code == 200
    finally:
        service.close()


@pytest.mark.parametrize("argv, says", [
    (["--api-key", " secret "], "starts or ends with spaces"),
    (["--api-key", "se cret"], "visible ASCII"),
    (["--host", "[::1"], "brackets go around an IPv6 address"),
    (["--host", "[example.com]"], "brackets go around an IPv6 address"),
    (["--max-body-mb", "0"], "--max-body-mb must be a positive number"),
    (["--shutdown-grace-s", "soon"], "--shutdown-grace-s must be a number"),
])
def test_serve_refuses_bad_host_key_and_limits_in_one_line(capsys, monkeypatch, argv, says):
    from qwen_trt.cli import main

    monkeypatch.delenv("QWEN_TRT_API_KEY", raising=False)
    assert main(["serve", *argv, "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_serve_reports_a_port_in_use_before_loading(capsys):
    from qwen_trt.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"Cannot listen on 127.0.0.1:{port}" in err[0], err


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_serve_takes_a_bracketed_ipv6_host(capsys):
    from qwen_trt.cli import main

    # past the host and bind checks: what fails is the model, which loads after them
    assert main(["serve", "--host", "[::1]", "--port", str(free_port()),
                 "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "--host" not in err and "Cannot listen" not in err and "nonexistent" in err, err
