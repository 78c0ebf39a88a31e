"""Grammars cannot stall the server: a schema past a size limit (bytes, nesting depth, enum
values) is a 400 naming the limit at once, before any xgrammar work; a slow one within the
limits is checked off the event loop and refused when it passes the time budget, while
``/health`` answers and another chat keeps streaming; the engine compiles grammars beside the
step (the serial path too), so other requests go on meanwhile, within the budget.

Constrained replies within max_tokens, on the tiny model through the API: a budget below the
shortest reply the grammar allows is a 400 naming both; from there up, tool_choice required
ends in a call and never shows markup as content (whole or streamed), json_object and an
optional recursive schema end in a valid document."""
from __future__ import annotations

import json
import threading
import time
import uuid

import re

import httpx
import jsonschema
import pytest

from qwen_trt.api.server import create_app
from qwen_trt.params import Grammar, SamplingParams
from qwen_trt.serving.service import InferenceService
from servers import app_in_thread

HEALTH_S = 1.0          # /health must answer within this (a loaded 2-core CI box: generous)
GAP_S = 1.5             # nor may the other chat's stream pause longer


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def constrained(schema: dict, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 16,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}, **extra}


@pytest.fixture(scope="module")
def origin(tiny_model_dir):
    from qwen_trt.backends.torch_backend import TorchBackend

    # its own backend: closing the service closes it (the session's tiny_backend is shared)
    service = InferenceService(TorchBackend.load(str(tiny_model_dir), device="cpu",
                                                 warmup=False))
    try:
        with app_in_thread(create_app(service, model_name="tiny")) as url:
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200
            yield url
    finally:
        service.close()


def post(origin: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{origin}/v1/chat/completions", json=body, timeout=timeout)


@pytest.mark.parametrize("body, limit", [
    (constrained(nested_arrays(650)), "QWEN_TRT_GRAMMAR_MAX_DEPTH"),
    (constrained({"enum": [f"value-{i:06d}" for i in range(100_000)]}),
     "QWEN_TRT_GRAMMAR_MAX_BYTES"),
    (constrained({"enum": list(range(5000))}), "QWEN_TRT_GRAMMAR_MAX_ENUM"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": nested_arrays(200)}}]},
     "QWEN_TRT_GRAMMAR_MAX_DEPTH"),
], ids=["650 nested arrays", "100k enum strings", "5000 enum values", "a deep tool"])
def test_a_schema_past_a_limit_is_a_400_at_once_naming_it(origin, body, limit):
    t = time.monotonic()
    r = post(origin, body)
    took = time.monotonic() - t
    assert r.status_code == 400, r.text[:300]
    msg = r.json()["error"]["message"]
    assert limit in msg and "\n" not in msg, msg
    assert took < 5.0, took         # before any xgrammar work (on main: 11 s to minutes)


# -- the engine: compiles beside the step -----------------------------------------------------
class SlowCompiler:
    """xgrammar's compiler, but each compile first sleeps ``delay_s`` outside the interpreter
    (as xgrammar's native compile does)."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s

    def compile_grammar(self, source):
        time.sleep(self.delay_s)
        return self.inner.compile_grammar(source)


def _schema_grammar() -> Grammar:
    return Grammar("json_schema", json.dumps({"type": "object", "description": uuid.uuid4().hex,
                                              "properties": {"a": {"type": "integer"}},
                                              "required": ["a"]}))


def _run_serial(runner, limit_s: float = 60) -> tuple[dict, dict, float]:
    """Step until done: events by request, when each finished, the longest step."""
    out: dict = {}
    done_at: dict = {}
    longest = 0.0
    deadline = time.monotonic() + limit_s
    while runner.has_work() and time.monotonic() < deadline:
        t = time.monotonic()
        events = runner.step()
        longest = max(longest, time.monotonic() - t)
        for ev in events:
            out.setdefault(ev.request_id, []).append(ev)
            if ev.finish:
                done_at[ev.request_id] = time.monotonic()
    return out, done_at, longest


def test_the_serial_runner_steps_on_while_a_grammar_compiles(tiny_backend, tiny_tokenizer,
                                                             monkeypatch):
    from qwen_trt.serving.serial import SerialRunner

    book = tiny_backend.grammars()
    monkeypatch.setattr(book, "_compiler", SlowCompiler(book._compiler, 1.5))
    runner = SerialRunner(tiny_backend)
    ids = tiny_tokenizer.encode("JSON please", add_special_tokens=False)
    runner.add(1, ids, SamplingParams(max_new_tokens=32, temperature=0,
                                      grammar=_schema_grammar()))
    runner.add(2, ids, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    out, done_at, longest = _run_serial(runner)
    assert longest < 1.0, longest              # no step waited for the 1.5 s compile
    assert done_at[2] < done_at[1]             # the plain request went ahead
    assert sum(len(e.token_ids) for e in out[2]) == 20
    text = tiny_tokenizer.decode([t for e in out[1] for t in e.token_ids][:-1])
    assert out[1][-1].finish == "stop" and isinstance(json.loads(text)["a"], int), text


def test_a_compile_past_the_budget_fails_only_its_request(tiny_backend, tiny_tokenizer,
                                                          monkeypatch):
    from qwen_trt.serving.serial import SerialRunner

    monkeypatch.setenv("QWEN_TRT_GRAMMAR_BUDGET_S", "0.3")
    book = tiny_backend.grammars()
    monkeypatch.setattr(book, "_compiler", SlowCompiler(book._compiler, 1.5))
    runner = SerialRunner(tiny_backend)
    ids = tiny_tokenizer.encode("JSON please", add_special_tokens=False)
    grammar = _schema_grammar()
    runner.add(1, ids, SamplingParams(max_new_tokens=32, grammar=grammar))
    runner.add(2, ids, SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
    out, _, longest = _run_serial(runner)
    assert longest < 1.0, longest
    (fail,) = out[1]
    assert fail.finish == "error" and "did not compile within 0.3 s" in fail.error
    assert "QWEN_TRT_GRAMMAR_BUDGET_S" in fail.error
    assert sum(len(e.token_ids) for e in out[2]) == 5
    t = time.monotonic()                        # refused again at once while it compiles on
    runner.add(3, ids, SamplingParams(max_new_tokens=32, grammar=grammar))
    out, _, _ = _run_serial(runner)
    assert out[3][-1].finish == "error" and time.monotonic() - t < 0.3


def test_compiled_grammars_are_kept_by_the_specs_hash(tiny_backend):
    from qwen_trt.fast.step.grammar import CACHE_SIZE

    book = tiny_backend.grammars()
    g = _schema_grammar()
    first = book.compile(g)
    assert book.compile(Grammar(g.kind, g.spec)) is first
    assert book.compile(_schema_grammar()) is not first        # one value changed
    assert len(book._cache) <= CACHE_SIZE
    assert all(len(k) == 64 for k in book._cache)              # SHA-256, not the spec itself


# -- constrained replies within max_tokens ---------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
RECURSIVE = {"type": "object", "properties": {"name": {"type": "string"},
                                              "child": {"$ref": "#"}}}


def _shortest(origin: str, body: dict) -> int:
    """The shortest reply's length, from the 400 of a request whose max_tokens is 1."""
    r = post(origin, {**body, "max_tokens": 1}, timeout=180)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "max_tokens", err
    m = re.search(r"'max_tokens' \(1\) cannot hold the shortest reply '[a-z_]+' allows "
                  r"\((\d+) tokens\)", err["message"])
    assert m, err["message"]
    return int(m.group(1))


def test_tool_choice_required_ends_in_a_call_and_shows_no_markup(origin):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], "tool_choice": "required", "temperature": 1.0}
    shortest = _shortest(origin, body)
    for extra, seed in ((0, 1), (3, 2), (12, 3)):
        whole = {**body, "max_tokens": shortest + extra, "seed": seed}
        r = post(origin, whole)
        assert r.status_code == 200, r.text[:300]
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert not choice["message"]["content"], choice
        (call,) = choice["message"]["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, WEATHER["function"]["parameters"])
        content, arguments, reasons = "", "", []
        with httpx.stream("POST", f"{origin}/v1/chat/completions",
                          json={**whole, "stream": True}, timeout=120) as s:
            for line in s.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for c in json.loads(line[6:]).get("choices", []):
                    content += c["delta"].get("content") or ""
                    for tc in c["delta"].get("tool_calls") or []:
                        arguments += tc["function"].get("arguments") or ""
                    reasons.append(c.get("finish_reason"))
        assert content == "" and "tool_call" not in content
        assert json.loads(arguments) == args and reasons[-1] == "tool_calls"


@pytest.mark.parametrize("response_format, schema", [
    ({"type": "json_object"}, {"type": "object"}),
    ({"type": "json_schema", "json_schema": {"name": "tree", "schema": RECURSIVE}}, RECURSIVE),
], ids=["json_object", "optional recursion"])
def test_a_constrained_reply_is_a_valid_document_at_every_budget_that_holds_one(
        origin, response_format, schema):
    body = {"messages": [{"role": "user", "content": "JSON please"}],
            "response_format": response_format, "temperature": 1.0}
    shortest = _shortest(origin, body)
    for budget in range(shortest, shortest + 10):
        r = post(origin, {**body, "max_tokens": budget, "seed": budget})
        assert r.status_code == 200, r.text[:300]
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (budget, choice)
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


# -- last: its runaway check's process is killed (the next check would start another) -----
def _poll_health(origin: str, until: float, out: list) -> None:
    with httpx.Client(timeout=30) as c:
        while time.monotonic() < until:
            t = time.monotonic()
            assert c.get(f"{origin}/health").status_code == 200
            out.append(time.monotonic() - t)
            time.sleep(0.05)


def _stream_chat(origin: str, arrivals: list, stop: threading.Event) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{origin}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
            if stop.is_set():
                return                                # leaving cancels the rest


def test_health_and_a_stream_go_on_while_a_slow_schema_is_checked_and_refused(origin,
                                                                            monkeypatch):
    """Within raised limits, 350 nested arrays take xgrammar seconds (about cubic in the
    depth): the check runs in a checker process, the budget (0.5 s) refuses it naming the
    budget (and ends that process), and meanwhile /health answers within a second and an
    unconstrained chat keeps streaming. The same schema again is refused at once."""
    warm = post(origin, constrained({"type": "object"}, max_tokens=4), timeout=180)
    assert warm.status_code == 200, warm.text      # a checker process is up (not budgeted)
    monkeypatch.setenv("QWEN_TRT_GRAMMAR_MAX_DEPTH", "100000")
    monkeypatch.setenv("QWEN_TRT_GRAMMAR_BUDGET_S", "0.5")
    arrivals: list[float] = []
    stop = threading.Event()
    chat = threading.Thread(target=_stream_chat, args=(origin, arrivals, stop), daemon=True)
    chat.start()
    deadline = time.monotonic() + 60
    while len(arrivals) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(arrivals) >= 3, "the chat did not start streaming"
    health: list[float] = []
    sent = time.monotonic()
    poller = threading.Thread(target=_poll_health, args=(origin, sent + 3.0, health),
                              daemon=True)
    poller.start()
    # a fresh schema each run (verdicts are kept by the spec's hash)
    schema = {**nested_arrays(350), "description": uuid.uuid4().hex}
    r = post(origin, constrained(schema))
    took = time.monotonic() - sent
    assert r.status_code == 400, r.text[:300]
    msg = r.json()["error"]["message"]
    assert "QWEN_TRT_GRAMMAR_BUDGET_S" in msg and "0.5 s" in msg, msg
    assert took < 0.5 + 2.0, took
    t = time.monotonic()
    again = post(origin, constrained(schema))
    assert again.status_code == 400 and time.monotonic() - t < 1.0
    poller.join(30)
    stop.set()
    assert len(health) >= 10 and max(health) < HEALTH_S, health
    window = [a for a in arrivals if sent <= a <= sent + 3.0]
    assert window, "the chat streamed nothing while the schema was checked"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= sent and a <= sent + 3.0]
    assert max(gaps) < GAP_S, max(gaps)
    chat.join(60)
