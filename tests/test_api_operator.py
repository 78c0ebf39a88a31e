"""An operator's view of ``qwen-trt serve`` (qwen_trt/api/access.py, metrics.py, schema.py): one
access-log line per request, ``x-request-id`` taken or made and echoed on every answer (the openai
SDK's ``_request_id``), 4xx/5xx counted by endpoint and status, vLLM-named gauges for the Gateway
API Inference Extension, ``/v1/models`` without paths, ``/health`` as JSON, ``Allow`` on a 405,
and ``/openapi.json`` refusing what the server refuses. An in-process engine with a scripted
reply, one uvicorn server for the module."""
from __future__ import annotations

import argparse
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from fakes import ScriptedBackend  # noqa: E402
from qwen_trt.api.metrics import ServerMetrics  # noqa: E402
from qwen_trt.api.server import ServerSettings, create_app  # noqa: E402
from qwen_trt.serving.service import InferenceService  # noqa: E402
from servers import app_in_thread, free_port, wait_for  # noqa: E402

NAME = "tiny-served"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record) -> None:
        self.records.append(record)

    def lines(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@pytest.fixture(scope="module")
def access_lines():
    log = logging.getLogger("qwen_trt.access")
    handler, level = Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)


@pytest.fixture(scope="module")
def server(tiny_tokenizer, access_lines):
    service = InferenceService(ScriptedBackend(tiny_tokenizer, "Hello there."))
    port = free_port()
    app = create_app(service, ServerSettings(port=port, model_name=NAME))

    @app.get("/boom")          # a route that crashes: the 500 path
    async def boom():
        raise RuntimeError("boom")

    with app_in_thread(app, port) as origin:
        yield origin, app
    service.close()


def chat(**kw) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def test_every_answer_carries_a_request_id_taken_from_the_client_or_made(server):
    origin, _ = server
    with httpx.Client(base_url=origin, timeout=30) as c:
        mine = c.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "abc-123.x"})
        assert mine.status_code == 200 and mine.headers["x-request-id"] == "abc-123.x"
        made = {c.get("/health").headers["x-request-id"] for _ in range(2)}
        assert len(made) == 2 and all(m.startswith("req_") for m in made)
        # a header that is not a short printable token is replaced, not echoed
        for bad in ("x" * 200, "two words", ""):
            r = c.get("/v1/models", headers={"x-request-id": bad})
            assert r.headers["x-request-id"].startswith("req_") and r.headers["x-request-id"] != bad
        for r in (c.get("/v1/nothing-here"), c.request("TRACE", "/v1/chat/completions"),
                  c.post("/v1/chat/completions", content=b"{"),
                  c.post("/v1/chat/completions", json=chat(stream=True)),
                  # a 500 (uvicorn closes the connection after it: a connection of its own)
                  httpx.get(f"{origin}/boom", timeout=30)):
            assert r.headers["x-request-id"].startswith("req_"), (r.status_code, r.headers)
    client = openai.OpenAI(base_url=f"{origin}/v1", api_key="x", max_retries=0, timeout=30)
    reply = client.chat.completions.create(**chat())
    assert reply._request_id and reply._request_id.startswith("req_")


def test_one_access_line_per_request_with_status_duration_and_id(server, access_lines):
    origin, _ = server
    access_lines.records.clear()
    with httpx.Client(base_url=origin, timeout=30) as c:
        c.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "line-1"})
        c.post("/v1/chat/completions", json=chat(stream=True), headers={"x-request-id": "line-2"})
        c.get("/v1/models/other%7Fmodel", headers={"x-request-id": "line-3"})
    # each line is written once its response has left: the client may read it first
    assert wait_for(lambda: len(access_lines.records) >= 3, 10)
    lines = access_lines.lines()
    assert len(lines) == 3, lines
    for line, rid, status in zip(lines, ("line-1", "line-2", "line-3"), (200, 200, 404)):
        assert line.startswith("127.0.0.1:") and f" {status} " in line
        assert line.endswith(f"request_id={rid}") and "ms " in line
    assert '"POST /v1/chat/completions"' in lines[0]
    assert "\x7f" not in lines[2] and "other\\x7fmodel" in lines[2]      # the client's text, escaped


def test_the_access_log_is_a_setting_and_can_be_turned_off(tiny_tokenizer, access_lines):
    from qwen_trt.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    assert serve.settings_from(parser.parse_args(["serve"]), {}).access_log is True
    off = parser.parse_args(["serve", "--no-access-log"])
    assert serve.settings_from(off, {}).access_log is False
    assert serve.settings_from(parser.parse_args(["serve"]),
                               {"QWEN_TRT_ACCESS_LOG": "0"}).access_log is False
    service = InferenceService(ScriptedBackend(tiny_tokenizer, "Hi."))
    app = create_app(service, ServerSettings(access_log=False))
    access_lines.records.clear()
    try:
        with app_in_thread(app) as origin:
            r = httpx.get(f"{origin}/v1/models", timeout=30)
            assert r.status_code == 200 and r.headers["x-request-id"]   # ids stay on
    finally:
        service.close()
    assert access_lines.lines() == []


def error_counts(origin: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{origin}/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "qwen_trt_http_errors":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[(s.labels["endpoint"], s.labels["status"])] = s.value
    return out


def test_4xx_and_5xx_are_counted_by_endpoint_and_status(server):
    origin, _ = server
    before = error_counts(origin)
    with httpx.Client(base_url=origin, timeout=30) as c:
        c.post("/v1/chat/completions", json=chat(model="another"))          # 404
        for _ in range(2):                                                  # 400
            c.post("/v1/chat/completions", content=b"not json",
                   headers={"content-type": "application/json"})
        c.request("TRACE", "/v1/chat/completions")                          # 405
        c.get("/v1/models/other")                                           # 404, templated
        c.get("/wp-login.php")                                              # 404, no route
        c.post("/v1/chat/completions", json=chat())                         # 200: not counted
    httpx.get(f"{origin}/boom", timeout=30)                                 # 500
    want = {("/v1/chat/completions", "404"): 1, ("/v1/chat/completions", "400"): 2,
            ("/v1/chat/completions", "405"): 1, ("/v1/models/{model_id:path}", "404"): 1,
            ("other", "404"): 1, ("/boom", "500"): 1}

    def grew():
        after = error_counts(origin)
        return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    # (counted as each response ends, which its client may see first)
    assert wait_for(lambda: grew() == want, 10), grew()


def test_models_health_and_405(server):
    origin, _ = server
    with httpx.Client(base_url=origin, timeout=30) as c:
        (card,) = c.get("/v1/models").json()["data"]
        assert card["id"] == card["root"] == NAME and "fake-model" not in str(card)
        assert c.get(f"/v1/models/{NAME}").json()["root"] == NAME
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ready"
        assert health.headers["content-type"] == "application/json"
        for method, path, allow in (("TRACE", "/v1/chat/completions", "POST"),
                                    ("GET", "/v1/completions", "POST"),
                                    ("DELETE", "/v1/models", "GET"),
                                    ("POST", "/v1/models", "GET")):       # no JSON type either
            r = c.request(method, path)
            assert r.status_code == 405 and r.headers["allow"] == allow, (method, path)
            assert r.json()["error"]["message"]


def test_vllm_named_gauges_for_the_inference_extension(server):
    origin, _ = server
    fams = {f.name: f for f in text_string_to_metric_families(
        httpx.get(f"{origin}/metrics", timeout=30).text)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        (sample,) = fams[name].samples
        assert fams[name].type == "gauge" and sample.labels == {"model_name": NAME}
        assert sample.value == 0

    class Status:      # what the engine process reports (RunnerStats as a dict)
        queued, running = 3, 2
        runner = {"kv_blocks_used": 64, "kv_blocks_total": 256, "extra": {"block_size": 32}}

    m = ServerMetrics(lambda: Status, lambda: 5, lambda: 2, model_name="m")
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    value = {n: fams[n].samples[0].value for n in fams if n.startswith("vllm:")}
    assert value == {"vllm:num_requests_waiting": 5, "vllm:num_requests_running": 2,
                     "vllm:kv_cache_usage_perc": 0.25, "vllm:gpu_cache_usage_perc": 0.25,
                     "vllm:cache_config_info": 1}
    assert fams["vllm:cache_config_info"].samples[0].labels == {
        "model_name": "m", "block_size": "32", "num_gpu_blocks": "256"}


def validator(doc: dict, schema_name: str):
    root = {"$ref": f"#/components/schemas/{schema_name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(root)


# (path, schema, body): what the document used to call valid and the server refuses
REFUSED = [
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "tool", "tool_call_id": "c1"}]}),
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    ("/v1/completions", "CompletionRequest", {"prompt": ""}),
    ("/v1/completions", "CompletionRequest", {"prompt": [[1], []]}),
    ("/tokenize", "TokenizeRequest", {}),
    ("/tokenize", "TokenizeRequest", {"prompt": "x", "messages": []}),
    ("/detokenize", "DetokenizeRequest", {"tokens": [1, 10 ** 6]}),
    ("/detokenize", "DetokenizeRequest", {"tokens": [-1]}),
]
ACCEPTED = [
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "42"}], "max_tokens": 2}),
    ("/v1/completions", "CompletionRequest", {"prompt": [[1, 2], [3]], "max_tokens": 2.0}),
    ("/tokenize", "TokenizeRequest", {"prompt": "x"}),
    ("/tokenize", "TokenizeRequest", {"messages": [{"role": "user", "content": "x"}]}),
    ("/detokenize", "DetokenizeRequest", {"tokens": [1, 2.0]}),       # 2.0 is an integer
]


def test_the_openapi_document_refuses_what_the_server_refuses(server):
    origin, _ = server
    with httpx.Client(base_url=origin, timeout=30) as c:
        doc = c.get("/openapi.json").json()
        for path, schema, body in REFUSED:
            assert not validator(doc, schema).is_valid(body), (path, body)
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
        for path, schema, body in ACCEPTED:
            validator(doc, schema).validate(body)
            r = c.post(path, json=body)
            assert r.status_code == 200, (path, body, r.text)
