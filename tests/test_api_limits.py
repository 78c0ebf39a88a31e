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

    r = httpx.post(f"{origin}/v1/chat/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
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
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
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
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ", b"a"),  # headers, slowly
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
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


# -- every endpoint bounds its input before the work --------------------------------------------
def post(origin: str, path: str, body, timeout=30, **headers) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{origin}{path}", content=raw, timeout=timeout,
                      headers={"content-type": "application/json", **headers})


HUGE_TEXT = "word " * 180_000          # 900 KB: under the module server's 1 MiB body limit


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": HUGE_TEXT}),
    ("/v1/completions", {"prompt": ["a short one", HUGE_TEXT]}),      # the short one waits too
    ("/tokenize", {"prompt": HUGE_TEXT}),
    ("/tokenize", {"messages": [{"role": "user", "content": HUGE_TEXT}]}),
])
def test_every_endpoint_refuses_an_unfittable_prompt_before_tokenising(server, monkeypatch,
                                                                        path, body):
    import qwen_trt.api.prompt as prompt
    import qwen_trt.api.server as srv

    calls = []
    tok = server[2].tokenizer
    for obj, name in ((srv, "text_ids"), (srv, "encode_messages"), (prompt, "text_ids"),
                      (tok, "encode")):
        real = getattr(obj, name, None)
        monkeypatch.setattr(obj, name, lambda *a, _real=real, **k: calls.append(1) or
                            _real(*a, **k), raising=False)
    t0 = time.perf_counter()
    err = assert_openai_error(post(server[0], path, body), 400)
    assert err["code"] == "context_length_exceeded" and "at least" in err["message"], err
    assert calls == [] and time.perf_counter() - t0 < 5


def test_prompts_past_the_bound_are_counted_and_replies_bounded(server):
    origin, _backend, service = server
    tok = service.tokenizer
    text = "word " * 8000                    # passes the bound; more tokens than the context
    n = len(tok.encode(text))
    assert n > 4096
    err = assert_openai_error(post(origin, "/v1/completions", {"prompt": text}), 400)
    assert f"{n} in the prompt" in err["message"] and "at least" not in err["message"]
    err = assert_openai_error(post(origin, "/tokenize", {"prompt": text}), 400)   # not n ids back
    assert f"resulted in {n} tokens" in err["message"] and err["param"] == "prompt"
    ok = post(origin, "/tokenize", {"prompt": "<|im_start|>hi there"})
    assert ok.status_code == 200
    assert ok.json()["tokens"] == tok.encode("<|im_start|>hi there")      # control tokens parsed
    assert assert_openai_error(post(origin, "/detokenize", {"tokens": [1] * 4097}),
                               400)["param"] == "tokens"
    ids = tok.encode("hello there")
    assert post(origin, "/detokenize", {"tokens": ids}).json()["prompt"] == "hello there"
    # a token-array prompt is measured without tokenising; one that fits is served
    err = assert_openai_error(post(origin, "/v1/completions", {"prompt": [1] * 4090}), 400)
    assert "4090 in the prompt" in err["message"]
    r = post(origin, "/v1/completions", {"prompt": [ids, tok.encode("hi")], "max_tokens": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_text_ids_is_the_tokenizers_own_encoding(tiny_tokenizer):
    from qwen_trt.api.prompt import PromptTooLong, text_ids

    for text in ("hello world", "<|im_start|>user\nhi<|im_end|>", "  a\t\n", "",
                 "e\u0301 \U0001d400 <tool_call>{}</tool_call>"):
        for special in (True, False):
            assert text_ids(tiny_tokenizer, text, add_special_tokens=special) == \
                tiny_tokenizer.encode(text, add_special_tokens=special), text
    n = len(tiny_tokenizer.encode("word " * 50))
    with pytest.raises(PromptTooLong) as e:
        text_ids(tiny_tokenizer, "word " * 50, limit=n - 1)
    assert e.value.tokens == n and not e.value.at_least


# -- 4xx, never 500 -----------------------------------------------------------------------------
DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("raw", [DEEP, b'{"prompt": ' + DEEP + b"}", b'{"tokens": ' + DEEP + b"}"])
def test_deeply_nested_json_is_400_on_every_endpoint(server, path, raw):
    assert assert_openai_error(post(server[0], path, raw), 400)["code"] == "invalid_json"


HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}}}}


def _tool(**fn):
    return [{"type": "function", "function": {**TOOL["function"], **fn}}]


def _called(name="f", arguments='{"a": "x"}'):
    return [*HI, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "\udc00"]}, "prompt[1]"),
    ("/tokenize", {"prompt": "x\udfff"}, "prompt"),
    ("/v1/chat/completions", {"messages": HI, "tools": _tool(description="d\ud800")},
     "tools[0].function.description"),
    ("/v1/chat/completions", {"messages": HI, "tools": _tool(parameters={
        "type": "object", "properties": {"a\udc00": {"type": "string"}}})},
     "tools[0].function.parameters.properties"),
    ("/tokenize", {"messages": HI, "tools": _tool(description="\ud800")},
     "tools[0].function.description"),
    ("/v1/chat/completions", {"messages": _called(name="f\ud800")},
     "messages[1].tool_calls[0].function.name"),
    ("/v1/chat/completions", {"messages": _called(arguments='{"a": "\ud800"}')},
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": _called(arguments={"a": "\udbff"})},
     "messages[1].tool_calls[0].function.arguments.a"),
])
def test_a_lone_surrogate_is_400_naming_where(server, path, body, param):
    err = assert_openai_error(post(server[0], path, {**body, "max_tokens": 2}), 400)
    assert err["param"] == param and "lone surrogate" in err["message"], err


# -- limits that can be met ---------------------------------------------------------------------
def test_more_choices_than_the_queue_holds_is_400_not_503(tiny_tokenizer):
    with serving(tiny_tokenizer, max_queue=4) as (origin, _backend, _service):
        for path, body, param in [
                ("/v1/chat/completions", {"messages": HI, "n": 5}, "n"),
                ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, "n"),
                ("/v1/completions", {"prompt": ["a", "b", "c", "d", "e"]}, "prompt")]:
            r = post(origin, path, {**body, "max_tokens": 2})
            err = assert_openai_error(r, 400)
            assert err["code"] == "too_many_choices" and err["param"] == param
            assert "--max-queue 4" in err["message"] and "retry-after" not in r.headers
        # exactly as many as the queue holds: served on an idle server
        r = post(origin, "/v1/chat/completions", {"messages": HI, "n": 4, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        r = post(origin, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4


# -- the loopback API is not a door for web pages -----------------------------------------------
BODY = {"messages": HI, "max_tokens": 2}


@pytest.mark.parametrize("ctype", [None, "text/plain", "text/plain;charset=UTF-8",
                                   "application/x-www-form-urlencoded", "multipart/form-data",
                                   "application/jsonp"])
def test_a_post_that_is_not_json_is_415_and_runs_nothing(server, ctype):
    origin, backend, _service = server
    before = len(backend.prompts)
    headers = {"Origin": "http://evil.example"}
    if ctype is not None:
        headers["Content-Type"] = ctype
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        r = httpx.post(f"{origin}{path}", content=json.dumps(BODY).encode(), headers=headers,
                       timeout=30)
        err = assert_openai_error(r, 415)
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
    assert len(backend.prompts) == before
    r = post(server[0], "/v1/chat/completions", BODY, **{"content-type": "Application/JSON; "
                                                         "charset=utf-8"})
    assert r.status_code == 200 and len(backend.prompts) == before + 1


def test_host_header_must_name_this_server(server):
    origin, backend, _service = server
    port = origin.rsplit(":", 1)[1]
    before = len(backend.prompts)
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example",
                 f"localhost.evil.example:{port}", "10.1.2.3", "[::1", "a b", ""):
        r = post(origin, "/v1/chat/completions", BODY, host=host)
        err = assert_openai_error(r, 421)
        assert err["code"] == "misdirected_request" and "--allowed-hosts" in err["message"]
        assert httpx.get(f"{origin}/v1/models", headers={"host": host}).status_code == 421
        assert httpx.get(f"{origin}/health", headers={"host": host}).status_code == 200  # probes
    assert len(backend.prompts) == before
    for host in ("localhost", f"localhost:{port}", "LOCALHOST.", "127.0.0.1", f"127.0.0.1:{port}",
                 f"[::1]:{port}", "[::1]"):
        assert post(origin, "/v1/chat/completions", BODY, host=host).status_code == 200, host
    assert len(backend.prompts) == before + 7


def test_allowed_hosts_one_check_in_one_place():
    from qwen_trt.api.guards import HostCheck
    from qwen_trt.commands.serve import settings_from
    from qwen_trt.errors import ConfigError

    class Args:
        api_key = served_model_name = None

    s = settings_from(Args(), {"QWEN_TRT_ALLOWED_HOSTS": " Chat.Example.com, [FE80::1] ,"})
    assert s.allowed_hosts == ("chat.example.com", "fe80::1")
    check = HostCheck(s.host, s.allowed_hosts)
    assert check.allows("chat.example.com:443") and check.allows("[fe80::1]:8000")
    assert not check.allows("other.example.com") and not check.allows("example.com")
    assert HostCheck("127.0.0.1", ("*",)).allows("anything.example")
    # a wildcard bind answers the address the connection came in on, not any name
    wide = HostCheck("0.0.0.0")
    assert wide.allows("10.0.0.5:8000", local="10.0.0.5") and not wide.allows("0.0.0.0")
    assert not wide.allows("rebind.example", local="10.0.0.5")
    assert HostCheck("10.0.0.7").allows("10.0.0.7:8000")
    for bad in ("http://x.example", "x.example:80", "x.example/path", "a b"):
        with pytest.raises(ConfigError, match="--allowed-hosts"):
            ServerSettings(allowed_hosts=(bad,))


@pytest.mark.browser
def test_a_page_from_another_origin_cannot_run_a_prompt_in_chromium(server):
    """Chromium, as a user's browser: a page from another origin sends the 'simple' POST no
    preflight guards (text/plain, no-cors), and a DNS-rebinding page (its own name resolving
    to the API, so its requests are same-origin) sends JSON. Neither reaches the engine."""
    import http.server
    import threading

    from playwright.sync_api import sync_playwright

    from test_browser_e2e import CHROMIUM_ARGS, _chromium

    origin, backend, _service = server
    api_port = int(origin.rsplit(":", 1)[1])
    page_html = (b"<!doctype html><title>evil</title><script>fetch('http://127.0.0.1:%d"
                 b"/v1/chat/completions', {method: 'POST', mode: 'no-cors', body: '%s', headers:"
                 b" {'Content-Type': 'text/plain'}}).finally(() => document.title = 'sent');"
                 b"</script>" % (api_port, json.dumps(BODY).encode()))

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):   # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(page_html)

        def log_message(self, *args):
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    before = len(backend.prompts)
    rebind = ("async () => { const r = await fetch('/v1/chat/completions', {method: 'POST', "
              f"headers: {{'Content-Type': 'application/json'}}, body: '{json.dumps(BODY)}'}});"
              " return r.status; }")
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=_chromium(), args=[
                *CHROMIUM_ARGS, "--host-resolver-rules=MAP rebind.test 127.0.0.1"])
            try:
                page = browser.new_page()
                page.set_default_timeout(30_000)
                page.goto(f"http://localhost:{site.server_address[1]}/")
                page.wait_for_function("document.title === 'sent'")
                page.goto(f"http://rebind.test:{api_port}/health")
                assert page.evaluate(rebind) == 421
            finally:
                browser.close()
    finally:
        site.shutdown()
    assert len(backend.prompts) == before
    assert post(origin, "/v1/chat/completions", BODY).status_code == 200    # the control
    assert len(backend.prompts) == before + 1
