"""The Responses API (``/v1/responses``) and Anthropic's Messages API (``/v1/messages``) on top of
the chat path, and tool-call arguments streamed as they are written.

Most tests run against an in-process engine whose replies are scripted (random weights never
call a tool), one uvicorn server for the module: every Responses body, stream event and item
list is checked against OpenAI's own schemas (tests/openai_spec.py: Response,
ResponseStreamEvent, ResponseItemList). The real clients (the openai SDK's ``responses.create``
/ ``responses.stream``, LangChain's ``ChatOpenAI(use_responses_api=True)``, the anthropic
SDK's ``messages.create`` / ``messages.stream``) run against ``qwen-trt serve`` on the tiny
model in tests/test_api_clients_tiny.py, on its server."""
from __future__ import annotations

import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from fakes import ScriptedBackend  # noqa: E402
from openai_spec import check  # noqa: E402
from qwen_trt.api.responses_store import ResponseStore, Stored, size_of  # noqa: E402
from qwen_trt.api.server import ServerSettings, create_app  # noqa: E402
from qwen_trt.serving.service import InferenceService  # noqa: E402
from servers import app_in_thread, free_port  # noqa: E402

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n' \
       '</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                 if k != "type"}}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city",
                     "input_schema": WEATHER["parameters"]}


class SlowBackend(ScriptedBackend):
    """A scripted reply, one token every ``delay_s``: each token its own engine wake-up."""

    delay_s = 0.0

    def stream(self, prompt_ids, params):
        for tid in super().stream(prompt_ids, params):
            if self.delay_s:
                time.sleep(self.delay_s)
            yield tid


class Service(InferenceService):
    """The in-process service, recording what each request was submitted with."""

    def __init__(self, backend):
        super().__init__(backend)
        self.submitted = []

    def submit(self, prompt_ids, params, dropped_turns=0):
        self.submitted.append((list(prompt_ids), params))
        return super().submit(prompt_ids, params, dropped_turns)


def _app(tokenizer, **settings):
    backend = SlowBackend(tokenizer, "Hello there, friend.", features=True)
    service = Service(backend)
    port = free_port()
    return backend, service, port, create_app(service, ServerSettings(port=port, **settings),
                                              model_name="fake")


@pytest.fixture(scope="module")
def env(tiny_tokenizer):
    backend, service, port, app = _app(tiny_tokenizer)
    with app_in_thread(app, port) as origin:
        client = openai.OpenAI(base_url=f"{origin}/v1", api_key="x", max_retries=0, timeout=30)
        yield backend, service, client, origin
    service.close()


@pytest.fixture
def script(env):
    backend = env[0]
    old = backend.text

    def set_text(text, delay_s=0.0):
        backend.text, backend.delay_s = text, delay_s
    yield set_text
    backend.text, backend.delay_s = old, 0.0


def events_of(origin, path, body, headers=None) -> list[tuple[str, dict]]:
    """A stream's named events, in order."""
    with httpx.stream("POST", f"{origin}{path}", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        out, name = [], None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                out.append((name, data))
    return out


def prompt_text(service, tokenizer) -> str:
    return tokenizer.decode(service.submitted[-1][0])


# -- Responses: whole replies, the store, input items --------------------------------------------
def test_create_get_input_items_delete_against_the_spec(env, tiny_tokenizer):
    _, service, client, origin = env
    resp = client.responses.create(model="fake", input="Say hi", instructions="Be brief.",
                                   metadata={"k": "v"}, max_output_tokens=64, temperature=0.5)
    assert resp.output_text == "Hello there, friend." and resp.status == "completed"
    assert resp.instructions == "Be brief." and resp.metadata == {"k": "v"}
    assert resp.temperature == 0.5 and resp.max_output_tokens == 64 and resp.store is True
    u = resp.usage
    assert u.input_tokens == len(service.submitted[-1][0]) and u.output_tokens >= 5
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    assert service.submitted[-1][1].temperature == 0.5
    assert service.submitted[-1][1].max_new_tokens == 64
    text = prompt_text(service, tiny_tokenizer)
    assert text.index("Be brief.") < text.index("Say hi")     # instructions: the system turn
    raw = httpx.get(f"{origin}/v1/responses/{resp.id}", timeout=10)
    assert raw.status_code == 200
    check(raw.json(), "Response")
    assert raw.json()["output"] == [o.model_dump(exclude_unset=True) for o in resp.output]
    items = httpx.get(f"{origin}/v1/responses/{resp.id}/input_items", timeout=10).json()
    check(items, "ResponseItemList")
    (item,) = items["data"]
    assert item["role"] == "user" and item["content"] == [{"type": "input_text",
                                                           "text": "Say hi"}]
    assert client.responses.delete(resp.id) is None
    assert httpx.get(f"{origin}/v1/responses/{resp.id}", timeout=10).status_code == 404
    assert httpx.delete(f"{origin}/v1/responses/{resp.id}", timeout=10).status_code == 404


def test_input_items_pages_in_either_order(env):
    _, _, client, origin = env
    resp = client.responses.create(model="fake", input=[
        {"role": "user", "content": f"turn {i}"} for i in range(5)])
    url = f"{origin}/v1/responses/{resp.id}/input_items"
    asc = httpx.get(url, params={"order": "asc", "limit": 2}, timeout=10).json()
    assert [d["content"][0]["text"] for d in asc["data"]] == ["turn 0", "turn 1"]
    assert asc["has_more"] and asc["first_id"] == asc["data"][0]["id"]
    nxt = httpx.get(url, params={"order": "asc", "limit": 2, "after": asc["last_id"]},
                    timeout=10).json()
    assert [d["content"][0]["text"] for d in nxt["data"]] == ["turn 2", "turn 3"]
    desc = httpx.get(url, timeout=10).json()
    assert [d["content"][0]["text"] for d in desc["data"]] == [f"turn {i}" for i in (4, 3, 2, 1,
                                                                                     0)]
    assert not desc["has_more"]
    for bad in ({"limit": 0}, {"order": "up"}, {"after": "nope"}):
        r = httpx.get(url, params=bad, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad))


def test_a_function_call_and_its_output_carry_across_turns(env, script, tiny_tokenizer):
    _, service, client, origin = env
    script("Checking.\n" + CALL)
    first = client.responses.create(model="fake", input="Weather in Paris?", tools=[WEATHER],
                                    instructions="Use tools.")
    check(httpx.get(f"{origin}/v1/responses/{first.id}", timeout=10).json(), "Response")
    msg, call = first.output
    assert msg.type == "message" and msg.content[0].text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "C"}
    assert call.call_id.startswith("call_") and call.status == "completed"
    script("It is 20 C in Paris.")
    second = client.responses.create(model="fake", previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "20 C, sunny"}],
        tools=[WEATHER])
    assert second.previous_response_id == first.id and second.instructions is None
    items = httpx.get(f"{origin}/v1/responses/{second.id}/input_items", timeout=10).json()
    check(items, "ResponseItemList")
    assert [(d["type"], d["call_id"], d["output"]) for d in items["data"]] == [
        ("function_call_output", call.call_id, "20 C, sunny")]
    text = prompt_text(service, tiny_tokenizer)
    # the whole conversation reached the model: the first question, the call, its output
    for part in ("Weather in Paris?", "Checking.", '"name": "get_weather"', '"city": "Paris"',
                 "20 C, sunny"):
        assert part in text, part
    assert "Use tools." not in text           # instructions are not carried over
    assert text.index("Weather in Paris?") < text.index('"city": "Paris"') < text.index(
        "20 C, sunny")
    third = client.responses.create(model="fake", previous_response_id=second.id,
                                    input="And tomorrow?")
    text = prompt_text(service, tiny_tokenizer)
    assert all(p in text for p in ("Weather in Paris?", '"city": "Paris"', "20 C, sunny",
                                   "It is 20 C in Paris.", "And tomorrow?"))
    assert third.output_text == "It is 20 C in Paris."
    r = httpx.post(f"{origin}/v1/responses", json={"input": "x",
                                                   "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"


def test_incomplete_at_max_output_tokens_and_store_false(env):
    _, _, client, origin = env
    resp = client.responses.create(model="fake", input="hi", max_output_tokens=2, store=False)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.usage.output_tokens == 2
    assert resp.store is False
    assert httpx.get(f"{origin}/v1/responses/{resp.id}", timeout=10).status_code == 404


def test_text_format_json_schema_and_tool_choice_reach_the_grammar(env, script):
    _, service, client, origin = env
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    script('{"n": 3}')
    resp = client.responses.create(model="fake", input="n?", text={"format": {
        "type": "json_schema", "name": "n", "schema": schema, "strict": True}})
    assert json.loads(resp.output_text) == {"n": 3}
    g = service.submitted[-1][1].grammar
    assert g.kind == "json_schema" and json.loads(g.spec) == schema
    from pydantic import BaseModel

    class N(BaseModel):
        n: int

    parsed = client.responses.parse(model="fake", input="n?", text_format=N)   # the SDK's helper
    assert parsed.output_parsed == N(n=3)
    assert service.submitted[-1][1].grammar.kind == "json_schema"
    client.responses.create(model="fake", input="x", text={"format": {"type": "json_object"}})
    assert service.submitted[-1][1].grammar.kind == "json_object"
    two = [WEATHER, {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
    script(CALL)
    for choice, names in (("required", ["get_weather", "get_time"]),
                          ({"type": "function", "name": "get_time"}, ["get_time"]),
                          ({"type": "allowed_tools", "mode": "required",
                            "tools": [{"type": "function", "name": "get_weather"}]},
                           ["get_weather"])):
        resp = client.responses.create(model="fake", input="x", tools=two, tool_choice=choice)
        g = service.submitted[-1][1].grammar
        assert g.kind == "tool_calls" and [t["name"] for t in json.loads(g.spec)["tools"]] == \
            names
        assert resp.output[-1].type == "function_call"


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}},
     "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                        "schema": {"type": "object"}, "strict": "yes"}}},
     "text.format.strict"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
])
def test_bad_requests_are_one_clear_400(env, body, param):
    r = httpx.post(f"{env[3]}/v1/responses", json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    check(r.json(), "ErrorResponse")
    assert err["param"] == param and len(err["message"]) < 300, err


def test_openapi_describes_the_responses_and_messages_routes(env):
    doc = httpx.get(f"{env[3]}/openapi.json", timeout=10).json()
    paths = doc["paths"]
    post = paths["/v1/responses"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/CreateResponseRequest")
    assert set(paths["/v1/responses/{response_id}"]) == {"get", "delete"}
    assert "/v1/responses/{response_id}/input_items" in paths
    err = paths["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]
    assert err["schema"]["$ref"].endswith("/AnthropicError")
    req = doc["components"]["schemas"]["MessagesRequest"]
    assert {"max_tokens", "messages"} <= set(req["required"])


def test_the_wrong_model_is_a_404(env):
    r = httpx.post(f"{env[3]}/v1/responses", json={"model": "gpt-x", "input": "x"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# -- Responses: the stream ------------------------------------------------------------------------
def test_stream_follows_the_spec_event_by_event(env, script):
    _, _, client, origin = env
    script("Let me check.\n" + CALL, delay_s=0.002)
    evs = events_of(origin, "/v1/responses", {"input": "Weather?", "tools": [WEATHER],
                                              "stream": True})
    for _, data in evs:
        check(data, "ResponseStreamEvent")
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    names = [n for n, _ in evs]
    squeeze = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    assert squeeze == ["response.created", "response.in_progress",
                       "response.output_item.added", "response.content_part.added",
                       "response.output_text.delta", "response.output_text.done",
                       "response.content_part.done", "response.output_item.done",
                       "response.output_item.added", "response.function_call_arguments.delta",
                       "response.function_call_arguments.done", "response.output_item.done",
                       "response.completed"]
    by = {}
    for n, d in evs:
        by.setdefault(n, []).append(d)
    text = "".join(d["delta"] for d in by["response.output_text.delta"])
    assert text == by["response.output_text.done"][0]["text"] == "Let me check."
    args = [d["delta"] for d in by["response.function_call_arguments.delta"]]
    assert len(args) > 1                      # written as they are generated, not in one piece
    done = by["response.function_call_arguments.done"][0]
    assert "".join(args) == done["arguments"] and done["name"] == "get_weather"
    assert json.loads(done["arguments"]) == {"city": "Paris", "unit": "C"}
    added = by["response.output_item.added"][1]["item"]
    assert added["name"] == "get_weather" and added["arguments"] == ""
    final = by["response.completed"][0]["response"]
    assert final["status"] == "completed" and [o["type"] for o in final["output"]] == [
        "message", "function_call"]
    assert final["output"][1]["arguments"] == done["arguments"]
    assert by["response.created"][0]["response"]["status"] == "in_progress"
    kept = httpx.get(f"{origin}/v1/responses/{final['id']}", timeout=10).json()
    assert kept == final
    # the openai SDK's stream helper assembles the same response
    with client.responses.stream(model="fake", input="Weather?", tools=[WEATHER]) as s:
        got = s.get_final_response()
    assert [o.type for o in got.output] == ["message", "function_call"]
    assert json.loads(got.output[1].arguments) == {"city": "Paris", "unit": "C"}


def test_stream_ending_at_the_limit_is_incomplete(env):
    evs = events_of(env[3], "/v1/responses", {"input": "x", "stream": True,
                                              "max_output_tokens": 2})
    for _, data in evs:
        check(data, "ResponseStreamEvent")
    assert evs[-1][0] == "response.incomplete"
    assert evs[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


# -- the store's bounds and --no-responses-store ------------------------------------------------
def _stored(text: str, history=()) -> Stored:
    item = {"type": "message", "id": "msg_x", "role": "user",
            "content": [{"type": "input_text", "text": text}], "status": "completed"}
    hist = tuple(history) + (item,)
    return Stored({"id": "r"}, (item,), hist, sum(size_of(i) for i in hist))


def test_store_is_lru_by_count_and_bytes():
    s = ResponseStore(max_count=2, max_bytes=10_000)
    for rid in "abc":
        assert s.put(rid, _stored(rid))
    assert "a" not in s and len(s) == 2 and s.evicted == 1
    s.get("b")                         # b is now the most recently used: c goes next
    s.put("d", _stored("d"))
    assert "b" in s and "c" not in s
    big = ResponseStore(max_count=100, max_bytes=2_000)
    one = _stored("x" * 300)
    assert 700 < one.size < 1_000
    assert big.put("a", one) and big.put("b", _stored("y" * 300))
    assert big.put("c", _stored("z" * 300))          # over 2000 bytes: a goes
    assert "a" not in big and big.bytes <= 2_000 and big.bytes == sum(
        e.size for e in (big.get("b"), big.get("c")))
    assert not big.put("huge", _stored("w" * 1_000)) and "huge" not in big
    # a response is charged its whole conversation, however much of it earlier turns share
    chained = _stored("next", history=_stored("x" * 300).history)
    assert chained.size > sum(size_of(i) for i in chained.history) > 300
    assert big.delete("b") and not big.delete("b")


def test_a_small_store_evicts_and_no_store_keeps_nothing(tiny_tokenizer):
    from qwen_trt.commands.serve import register, settings_from

    _, service, port, app = _app(tiny_tokenizer, responses_store_max=2)
    with app_in_thread(app, port) as origin:
        client = openai.OpenAI(base_url=f"{origin}/v1", api_key="x", max_retries=0, timeout=30)
        ids = [client.responses.create(model="fake", input=f"q{i}").id for i in range(3)]
        got = [httpx.get(f"{origin}/v1/responses/{i}", timeout=10).status_code for i in ids]
        assert got == [404, 200, 200]
        r = httpx.post(f"{origin}/v1/responses", json={"input": "x",
                                                       "previous_response_id": ids[0]})
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    service.close()
    _, service, port, app = _app(tiny_tokenizer, responses_store=False)
    with app_in_thread(app, port) as origin:
        client = openai.OpenAI(base_url=f"{origin}/v1", api_key="x", max_retries=0, timeout=30)
        resp = client.responses.create(model="fake", input="hi")
        assert resp.store is False and resp.output_text
        assert httpx.get(f"{origin}/v1/responses/{resp.id}", timeout=10).status_code == 404
        r = httpx.post(f"{origin}/v1/responses", json={"input": "x",
                                                       "previous_response_id": resp.id})
        assert r.status_code == 400 and "--no-responses-store" in r.json()["error"]["message"]
    service.close()
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    on = settings_from(parser.parse_args(["serve"]), environ={})
    assert on.responses_store and on.responses_store_max == 1024
    assert not settings_from(parser.parse_args(["serve", "--no-responses-store"]),
                             environ={}).responses_store
    assert not settings_from(parser.parse_args(["serve"]),
                             environ={"QWEN_TRT_RESPONSES_STORE": "0"}).responses_store
    small = settings_from(parser.parse_args(["serve", "--responses-store-max", "5",
                                             "--responses-store-mb", "0.5"]), environ={})
    assert (small.responses_store_max, small.responses_store_mb) == (5, 0.5)


def test_waiting_streams_get_keep_alives_then_their_events(tiny_tokenizer):
    backend, service, port, app = _app(tiny_tokenizer, sse_keepalive_s=0.05)
    with app_in_thread(app, port) as origin:
        for path, body, last in (
                ("/v1/responses", {"input": "x", "stream": True}, "response.completed"),
                ("/v1/messages", {"max_tokens": 50, "stream": True,
                                  "messages": [{"role": "user", "content": "x"}]},
                 "message_stop")):
            backend.gate.clear()              # the engine holds the first token back
            with httpx.stream("POST", f"{origin}{path}", json=body, timeout=30) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line == ": keep-alive":
                        break
                backend.gate.set()
                rest = [ln for ln in lines if ln.startswith("event: ")]
            assert rest[-1] == f"event: {last}", path
    service.close()


# -- chat: tool-call arguments stream; allowed_tools -----------------------------------------
def test_chat_streams_tool_arguments_as_they_are_generated(env, script, tiny_tokenizer):
    _, service, client, origin = env
    script(CALL, delay_s=0.002)
    two = [CHAT_WEATHER, {"type": "function", "function": {"name": "get_time"}}]
    with httpx.stream("POST", f"{origin}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "tools": two, "stream": True,
            "tool_choice": {"type": "allowed_tools", "allowed_tools": {
                "mode": "auto", "tools": [{"type": "function",
                                           "function": {"name": "get_weather"}}]}}},
            timeout=30) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines()
                  if ln.startswith("data: ") and ln != "data: [DONE]"]
    for c in chunks:
        check(c, "CreateChatCompletionStreamResponse")
    text = prompt_text(service, tiny_tokenizer)
    assert '"get_weather"' in text and "get_time" not in text     # only the allowed tool
    deltas = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    parts = [d["function"]["arguments"] for d in deltas[1:]]
    assert len(parts) > 1 and all(parts)
    assert json.loads("".join(parts)) == {"city": "Paris", "unit": "C"}
    whole = client.chat.completions.create(model="fake", messages=[{"role": "user",
                                                                    "content": "x"}],
                                           tools=two)
    assert whole.choices[0].message.tool_calls[0].function.arguments == "".join(parts)


# -- Anthropic Messages (scripted) ----------------------------------------------------------------
def test_messages_blocks_stop_reasons_and_stream_events(env, script, tiny_tokenizer):
    _, service, _, origin = env
    script("Checking.\n" + CALL, delay_s=0.002)
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": [
                   {"type": "text", "text": "Let me look."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                    "input": {"city": "Oslo"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5 C"},
                   {"type": "text", "text": "And Paris?"}]}]
    body = {"model": "fake", "max_tokens": 200, "system": [{"type": "text", "text": "Terse."}],
            "messages": history, "tools": [ANTHROPIC_WEATHER]}
    r = httpx.post(f"{origin}/v1/messages", json=body, timeout=30)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["type"] == "message" and msg["stop_reason"] == "tool_use"
    assert [b["type"] for b in msg["content"]] == ["text", "tool_use"]
    assert msg["content"][0]["text"] == "Checking."
    assert msg["content"][1]["name"] == "get_weather"
    assert msg["content"][1]["input"] == {"city": "Paris", "unit": "C"}
    assert msg["usage"]["input_tokens"] == len(service.submitted[-1][0])
    text = prompt_text(service, tiny_tokenizer)
    order = ["Terse.", "Weather in Oslo?", "Let me look.", '"city": "Oslo"', "5 C", "And Paris?"]
    assert [text.index(p) for p in order] == sorted(text.index(p) for p in order)
    evs = events_of(origin, "/v1/messages", {**body, "stream": True})
    names = [n for n, _ in evs]
    squeeze = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    assert squeeze == ["message_start", "content_block_start", "content_block_delta",
                       "content_block_stop", "content_block_start", "content_block_delta",
                       "content_block_stop", "message_delta", "message_stop"]
    json_parts = [d["delta"]["partial_json"] for n, d in evs
                  if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert len(json_parts) > 1 and json.loads("".join(json_parts)) == msg["content"][1]["input"]
    assert evs[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    script("one two three four")
    r = httpx.post(f"{origin}/v1/messages", json={
        "model": "fake", "max_tokens": 50, "stop_sequences": ["three"],
        "messages": [{"role": "user", "content": "count"}]}, timeout=30).json()
    assert (r["stop_reason"], r["stop_sequence"]) == ("stop_sequence", "three")
    assert r["content"] == [{"type": "text", "text": "one two "}]
    r = httpx.post(f"{origin}/v1/messages", json={
        "model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
        timeout=30).json()
    assert r["stop_reason"] == "max_tokens" and r["usage"]["output_tokens"] == 2
    counted = httpx.post(f"{origin}/v1/messages/count_tokens", json={
        "model": "fake", "messages": [{"role": "user", "content": "count"}]}, timeout=30)
    assert counted.json() == {"input_tokens": len(service.submitted[-2][0])}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    httpx.post(f"{origin}/v1/messages", json={
        "model": "fake", "max_tokens": 5, "output_config": {"format": {
            "type": "json_schema", "schema": schema}},
        "messages": [{"role": "user", "content": "x"}]}, timeout=30)
    g = service.submitted[-1][1].grammar
    assert g.kind == "json_schema" and json.loads(g.spec) == schema


@pytest.mark.parametrize("body, status, where", [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "messages[0].content[0]"),
    ({"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]},
     400, "temperature"),
    ({"max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "messages": [{"role": "user", "content": "x"}]}, 400, "tools[0]"),
    ({"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
     404, "claude-x"),
])
def test_messages_errors_have_anthropics_shape(env, body, status, where):
    r = httpx.post(f"{env[3]}/v1/messages", json=body, timeout=10)
    assert r.status_code == status
    got = r.json()
    assert got["type"] == "error" and set(got["error"]) == {"type", "message"}
    assert got["error"]["type"] == ("invalid_request_error" if status == 400
                                    else "not_found_error")
    assert where in got["error"]["message"] and len(got["error"]["message"]) < 300
