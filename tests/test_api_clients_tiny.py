"""``qwen-trt serve`` on the tiny model (real engine, random weights) driven by LangChain's
``ChatOpenAI`` and the openai SDK: tools in the history, a tool round trip, n, completions,
models.retrieve, the Responses API (``responses.create`` / ``.stream``, ``previous_response_id``,
LangChain's ``use_responses_api=True``); every reply checked against OpenAI's schemas. And the
anthropic SDK's ``messages.create`` / ``.stream`` (x-api-key and Bearer).

Random weights never call a tool on their own, so the round trips that need the model to call
one use ``tool_choice`` required / named, and structured output uses ``response_format``: both
need the engine's constrained decoding (``qwen_trt.fast.step.grammar``), and those tests run
once that module exists (skipped otherwise). The same for logprobs, which the engine fills in
``Delta.logprobs`` alongside the grammar work."""
from __future__ import annotations

import importlib.util
import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from openai_spec import check  # noqa: E402
from servers import start_serve  # noqa: E402

KEY = "tiny-key"
needs_engine_grammar = pytest.mark.skipif(
    importlib.util.find_spec("qwen_trt.fast.step.grammar") is None,
    reason="needs the engine's constrained decoding and logprobs (qwen_trt.fast.step.grammar)")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_serve(tiny_model_dir, tmp_path_factory.mktemp("serve"), "--api-key", KEY,
                    "--max-seq-len", "1024", "--served-model-name", "tiny")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_model(server):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model="tiny", temperature=0,
                         max_tokens=160, max_retries=0, timeout=120)


def history():
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_abc", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_abc", "content": "20 C and sunny"}]


def test_tools_and_a_tool_history_on_the_real_engine(server, client):
    body = {"model": "tiny", "messages": history(), "tools": [WEATHER], "max_tokens": 16,
            "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    check(r.json(), "CreateChatCompletionResponse")
    out = client.chat.completions.create(**body, stream=True)
    chunks = list(out)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
    for c in chunks:
        assert "<tool_call>" not in (c.choices[0].delta.content or "")


def test_langchain_bind_tools_with_a_tool_message_in_history(chat_model):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "20 C"

    bound = chat_model.bind_tools([get_weather])
    ai = AIMessage(content="", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"},
                                            "id": "call_1"}])
    reply = bound.invoke([HumanMessage("Weather in Paris?"), ai,
                          ToolMessage("20 C", tool_call_id="call_1")])
    assert isinstance(reply.content, str)
    assert reply.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_n_completions_and_models_on_the_real_engine(server, client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                  "content": "hi"}],
                                         n=2, temperature=1.0, seed=3, max_tokens=8)
    assert [c.index for c in out.choices] == [0, 1]
    again = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                    "content": "hi"}],
                                           n=2, temperature=1.0, seed=3, max_tokens=8)
    assert [c.message.content for c in again.choices] == [c.message.content
                                                          for c in out.choices]
    comp = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=6,
                                     temperature=0)
    check(comp.model_dump(exclude_unset=True), "CreateCompletionResponse")
    whole = client.chat.completions.create(model="tiny", messages=[{
        "role": "user", "content": "x"}], max_tokens=4, temperature=0)
    check(whole.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
    assert client.models.retrieve("tiny").id == "tiny"


@needs_engine_grammar
def test_langchain_tool_round_trip_with_a_named_tool_choice(chat_model):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "20 C"

    for choice in ("get_weather", "required"):
        bound = chat_model.bind_tools([get_weather], tool_choice=choice)
        ai = bound.invoke([HumanMessage("Weather in Paris?")])
        (call,) = ai.tool_calls[:1]
        assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
        assert ai.response_metadata["finish_reason"] == "tool_calls"
        final = chat_model.bind_tools([get_weather]).invoke(
            [HumanMessage("Weather in Paris?"), ai, ToolMessage("20 C", tool_call_id=call["id"])])
        assert isinstance(final.content, str)


@needs_engine_grammar
def test_langchain_structured_output_json_schema_and_json_mode(chat_model):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        population: int

    got = chat_model.with_structured_output(City, method="json_schema").invoke("A city?")
    assert isinstance(got, City)
    raw = chat_model.with_structured_output(None, method="json_mode").invoke(
        "Reply in JSON.")
    assert isinstance(raw, dict)


@needs_engine_grammar
@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_tools_response_format_and_logprobs(client, stream):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "n?"}], max_tokens=64,
              response_format={"type": "json_schema", "json_schema": {
                  "name": "n", "schema": schema, "strict": True}},
              logprobs=True, top_logprobs=3, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        entries = [e for c in chunks if c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content or ()]
    else:
        out = client.chat.completions.create(**kw)
        text = out.choices[0].message.content
        entries = out.choices[0].logprobs.content
    assert isinstance(json.loads(text)["n"], int)
    # alternatives the grammar forbids are left out of top_logprobs: up to 3, the token among them
    assert entries and all(1 <= len(e.top_logprobs) <= 3 and e.logprob <= 0 for e in entries)
    assert all(e.token == e.top_logprobs[0].token for e in entries)   # greedy: the best allowed
    assert any(len(e.top_logprobs) == 3 for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == text
    tools_kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                    tools=[WEATHER], tool_choice="required", max_tokens=160)
    if stream:
        with client.chat.completions.stream(**tools_kw) as s:
            msg = s.get_final_completion().choices[0].message
    else:
        msg = client.chat.completions.create(**tools_kw).choices[0].message
    assert msg.tool_calls and msg.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(msg.tool_calls[0].function.arguments)["city"], str)


# -- the Responses and Messages APIs (scripted tests: tests/test_api_responses.py) ---------------
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city",
                     "input_schema": WEATHER["function"]["parameters"]}


def test_openai_sdk_and_langchain_responses_api(server, client):
    first = client.responses.create(model="tiny", input="Hello", max_output_tokens=8,
                                    temperature=0)
    assert first.status in ("completed", "incomplete") and first.usage.output_tokens >= 1
    with client.responses.stream(model="tiny", input="Hello", max_output_tokens=8,
                                 temperature=0) as s:
        evs = list(s)
    kinds = [ev.type for ev in evs]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    # the SDK's get_final_response() wants response.completed; random weights rarely stop
    # before the limit, and then the stream ends with response.incomplete (as OpenAI's)
    assert kinds[-1] == f"response.{first.status}"
    streamed = evs[-1].response
    assert streamed.output_text == first.output_text          # greedy: the same reply
    raw = httpx.get(f"{server.url}/v1/responses/{streamed.id}",
                    headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    check(raw.json(), "Response")
    follow = client.responses.create(model="tiny", input="More", previous_response_id=first.id,
                                     max_output_tokens=4)
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    lc = pytest.importorskip("langchain_openai")
    chat = lc.ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model="tiny",
                         temperature=0, max_tokens=8, max_retries=0, timeout=120,
                         use_responses_api=True)
    reply = chat.invoke("Hello")
    assert reply.text == first.output_text
    assert reply.response_metadata["id"].startswith("resp_")
    chunks = list(chat.stream("Hello"))
    assert "".join(c.text for c in chunks) == first.output_text
    # a tool call and its result in the history go out as function_call items
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "20 C"

    ai = AIMessage(content="", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"},
                                            "id": "call_1"}])
    reply = chat.bind_tools([get_weather]).invoke(
        [HumanMessage("Weather in Paris?"), ai, ToolMessage("20 C", tool_call_id="call_1")])
    assert isinstance(reply.text, str) and reply.response_metadata["status"] in (
        "completed", "incomplete")


def test_anthropic_sdk_messages(server):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    kw = dict(model="tiny", max_tokens=8, system="Be brief.", extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!"},
                        {"role": "user", "content": "Weather?"}],
              tools=[ANTHROPIC_WEATHER])
    msg = client.messages.create(**kw)
    assert msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert msg.usage.input_tokens > 10 and 1 <= msg.usage.output_tokens <= 8
    with client.messages.stream(**kw) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:      # past the key check: a 400
        bearer.messages.create(**{**kw, "messages": []})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    wrong = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(**kw)
    assert e.value.body["error"]["type"] == "authentication_error"
