"""Constrained decoding, logprobs, frequency penalty and min-p on CPU (the tiny random model):
every backend path (HF torch backend, fast-path batch-1 decoder, batched runner) produces
output that parses and validates for json_object, a json_schema with required properties and
tool calls, within a bounded max_new_tokens; logprobs are the model's; unconstrained rows in a
mixed batch are unaffected."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from qwen_trt.serving.scheduler import batch_runner_for
import torch

from qwen_trt.fast.step.grammar import GrammarError, check_grammar
from qwen_trt.fast.step.sampling import SamplerState, pick, sampler_kind
from qwen_trt.serving.generation import ReplyStream
from qwen_trt.params import Grammar, SamplingParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "ok": {"type": "boolean"},
                         "unit": {"enum": ["c", "f"]}},
          "required": ["name", "age", "tags", "ok", "unit"]}
TOOLS = [{"name": "get_weather",
          "parameters": {"type": "object",
                         "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city", "days"]}},
         {"name": "ping", "parameters": {"type": "object", "properties": {}}}]
GRAMMARS = {
    "json_object": Grammar("json_object"),
    "json_schema": Grammar("json_schema", json.dumps(SCHEMA)),
    "tool_calls": Grammar("tool_calls", json.dumps({"tools": TOOLS, "parallel": False})),
    "tool_calls_parallel": Grammar("tool_calls", json.dumps({"tools": TOOLS, "parallel": True})),
}
MAX_NEW = 96      # the tiny tokenizer spells most text a character or two per token
CALL = re.compile(r'<tool_call>\n(.*?)\n</tool_call>', re.S)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny matrices: threads only contend on a loaded 2-core CI machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def check_reply(kind: str, text: str) -> None:
    """``text`` parses and validates for grammar ``kind`` (AssertionError / ValueError if not)."""
    if kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        blocks = CALL.findall(text)
        assert blocks and "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks) == text
        assert len(blocks) == 1 or kind == "tool_calls_parallel"
        by_name = {t["name"]: t["parameters"] for t in TOOLS}
        for b in blocks:
            call = json.loads(b)
            assert set(call) == {"name", "arguments"} and call["name"] in by_name
            jsonschema.validate(call["arguments"], by_name[call["name"]])


def prompt(tokenizer, text="Reply in JSON, please."):
    return tokenizer.encode(text, add_special_tokens=False)


def run(backend, ids, params):
    with ReplyStream(backend, ids, params) as rs:
        deltas = list(rs.deltas())
    return rs.reply, deltas


# -- check_grammar: no tokenizer, one line per problem ------------------------------------------
@pytest.mark.parametrize("grammar", list(GRAMMARS.values()), ids=list(GRAMMARS))
def test_good_grammars_pass_the_check(grammar):
    check_grammar(grammar)


@pytest.mark.parametrize("grammar, words", [
    (Grammar("json_schema", "{"), "not valid JSON"),
    (Grammar("json_schema", '{"type": "objectx"}'), "objectx"),
    (Grammar("json_schema", '{"type": "string", "pattern": "(("}'), "parenthesis"),
    (Grammar("json_schema", '["not", "a", "schema"]'), "JSON object"),
    (Grammar("tool_calls", '{"tools": []}'), "tools"),
    (Grammar("tool_calls", '{"tools": [{"name": ""}]}'), "name"),
    (Grammar("tool_calls", '{"tools": [{"name": "f", "parameters": {"type": "nope"}}]}'),
     "'f'"),
    (Grammar("tool_calls", '{"tools": [{"name": "f"}], "parallel": "yes"}'), "parallel"),
])
def test_bad_grammars_are_one_line_value_errors(grammar, words):
    with pytest.raises(ValueError) as e:
        check_grammar(grammar)
    assert isinstance(e.value, GrammarError)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and len(msg) < 300


def test_grammar_kind_is_checked_once_in_params():
    with pytest.raises(ValueError, match="grammar kind"):
        Grammar("yaml")


def test_grammar_book_on_the_qwen3_vocabulary_width(tiny_tokenizer):
    """The mask width of the real model (151,936 logits) against a smaller tokenizer: the
    padding ids are never allowed."""
    from qwen_trt.fast.step.grammar import GrammarBook

    book = GrammarBook(tiny_tokenizer, 151936, (514,))
    c = book.constraint(GRAMMARS["json_schema"], 64)
    mask = c.fill()
    assert mask.shape == (151936 // 32,)
    allowed = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    assert allowed[len(tiny_tokenizer):].sum() == 0 and allowed.sum() > 0


# -- the HF torch backend ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(GRAMMARS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_torch_backend_output_validates(tiny_backend, tiny_tokenizer, kind, temperature):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, seed=3,
                            grammar=GRAMMARS[kind])
    reply, _ = run(tiny_backend, prompt(tiny_tokenizer), params)
    assert reply.metrics.finish_reason == "stop", reply.text
    check_reply(kind, reply.text)


def test_without_the_grammar_the_same_request_is_not_json(tiny_backend, tiny_tokenizer):
    """What the constraint changes: random weights alone never write valid JSON."""
    reply, _ = run(tiny_backend, prompt(tiny_tokenizer),
                   SamplingParams(max_new_tokens=MAX_NEW, temperature=0))
    with pytest.raises(ValueError):
        check_reply("json_object", reply.text)


def test_a_short_budget_still_ends_in_valid_json(tiny_backend, tiny_tokenizer):
    """Near max_new_tokens the constraint closes the value: the reply stops complete."""
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=0,
                            grammar=GRAMMARS["json_object"])
    reply, _ = run(tiny_backend, prompt(tiny_tokenizer), params)
    assert reply.metrics.finish_reason == "stop" and reply.metrics.tokens <= 24
    check_reply("json_object", reply.text)


def test_logprobs_are_the_models_log_softmax(tiny_backend, tiny_tokenizer):
    ids = prompt(tiny_tokenizer, "The quick brown fox")
    params = SamplingParams(max_new_tokens=12, temperature=0, logprobs=5, ignore_eos=True)
    reply, deltas = run(tiny_backend, ids, params)
    got = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token_id for lp in got] == reply.token_ids and len(got) == 12
    with torch.inference_mode():
        logits = tiny_backend.model(torch.tensor([ids + reply.token_ids])).logits[0].float()
    want = torch.log_softmax(logits[len(ids) - 1:-1], dim=-1)
    for step, lp in enumerate(got):
        assert lp.logprob == pytest.approx(want[step, lp.token_id].item(), abs=1e-4)
        top = torch.topk(want[step], 5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert lp.top[0][0] == lp.token_id                 # greedy: the top token


def test_deltas_carry_every_token_once_without_the_stop(tiny_backend, tiny_tokenizer):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=5, logprobs=0,
                            grammar=GRAMMARS["json_schema"])
    reply, deltas = run(tiny_backend, prompt(tiny_tokenizer, "你好，世界！🚀"), params)
    assert reply.metrics.finish_reason == "stop"
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == reply.token_ids and reply.metrics.tokens == len(ids) + 1
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert all(lp.top == () and lp.logprob <= 0 for d in deltas for lp in d.logprobs)
    assert "".join(d.text for d in deltas) == reply.text
    # without logprobs asked for, the deltas carry ids only
    _, plain = run(tiny_backend, prompt(tiny_tokenizer), SamplingParams(max_new_tokens=8))
    assert all(d.logprobs == () for d in plain) and sum(len(d.token_ids) for d in plain) >= 7


# -- the sampler's new settings ----------------------------------------------------------------
def test_frequency_penalty_counts_each_generation():
    st = SamplerState(8, 6, "cpu")
    st.set(SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25))
    for tok in (3, 3, 1):
        st.advance(torch.tensor([tok]))
    out = st.penalize(torch.zeros(1, 6))[0]
    assert out.tolist() == pytest.approx([0, -0.75, 0, -1.25, 0, 0])


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))

    def draws(min_p):
        seen = set()
        for seed in range(150):
            params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=min_p,
                                    seed=seed, max_new_tokens=1)
            st = SamplerState(1, 4, "cpu")
            st.set(params)
            seen.add(int(pick(logits, sampler_kind(params), st)))
        return seen

    assert draws(0.0) == {0, 1, 2, 3}
    assert draws(0.2) == {0, 1, 2}          # 0.08 < 0.2 x 0.5
    assert draws(0.5) == {0, 1}


def test_top_p_zero_is_greedy(tiny_backend, tiny_tokenizer):
    ids = prompt(tiny_tokenizer)
    a, _ = run(tiny_backend, ids, SamplingParams(max_new_tokens=10, top_p=0, seed=1))
    b, _ = run(tiny_backend, ids, SamplingParams(max_new_tokens=10, temperature=0))
    assert a.token_ids == b.token_ids


# -- the fast path: batch-1 decoder and the batched runner (eager on CPU) ----------------------
@pytest.fixture(scope="module")
def fast_backend(tiny_model_dir):
    from qwen_trt.backends.fast_backend import FastBackend

    return FastBackend.load(str(tiny_model_dir), device="cpu", warmup=False)


@pytest.fixture(scope="module")
def runner_backend(tiny_model_dir):
    from qwen_trt.backends.fast_backend import FastBackend
    from qwen_trt.serving.scheduler import SchedulerConfig

    backend = FastBackend.load(str(tiny_model_dir), device="cpu", warmup=False, for_runner=True)
    batch_runner_for(backend, SchedulerConfig(max_batch=6, token_budget=64), kv_tokens=4096)
    return backend


@pytest.mark.parametrize("kind", ["json_schema", "tool_calls_parallel"])
def test_fast_decoder_matches_the_torch_backend(fast_backend, tiny_backend, tiny_tokenizer,
                                                kind):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, logprobs=3,
                            grammar=GRAMMARS[kind])
    ids = prompt(tiny_tokenizer)
    fast, fast_deltas = run(fast_backend, ids, params)
    ref, ref_deltas = run(tiny_backend, ids, params)
    check_reply(kind, fast.text)
    assert fast.token_ids == ref.token_ids
    for a, b in zip([lp for d in fast_deltas for lp in d.logprobs],
                    [lp for d in ref_deltas for lp in d.logprobs]):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-3)


def _mixed_requests(tokenizer, n=16):
    texts = ["Reply in JSON.", "What's the weather in Paris?", "Hello, how are you today?",
             "你好，世界！", "The quick brown fox jumps over the lazy dog."]
    reqs = {}
    for i in range(n):
        ids = prompt(tokenizer, texts[i % len(texts)] + " " * (i % 3))
        kind = ("json_schema", "tool_calls", None, "json_object", None, "tool_calls_parallel",
                None, None)[i % 8]
        params = SamplingParams(
            max_new_tokens=MAX_NEW if kind else 8 + i, temperature=0.0 if i % 3 else 0.9,
            seed=i, logprobs=(i % 4) if i % 5 else None, frequency_penalty=0.3 * (i % 2),
            min_p=0.05 * (i % 2), grammar=GRAMMARS[kind] if kind else None,
            ignore_eos=kind is None)
        reqs[i] = (ids, params, kind)
    return reqs


def test_sixteen_mixed_requests_in_one_batch_are_each_correct(runner_backend, fast_backend,
                                                              tiny_tokenizer):
    """Constrained and unconstrained, greedy and sampled, with and without logprobs, 16
    requests through a 6-wide runner at once: each gives what it gives alone on the batch-1
    decoder, and the constrained ones validate."""
    runner = batch_runner_for(runner_backend)
    reqs = _mixed_requests(tiny_tokenizer)
    out = {i: ([], [], None) for i in reqs}
    for i, (ids, params, _) in reqs.items():
        runner.add(i, ids, params)
    steps = 0
    while runner.has_work():
        for ev in runner.step():
            toks, lps, fin = out[ev.request_id]
            assert not ev.logprobs or len(ev.logprobs) == len(ev.token_ids)
            out[ev.request_id] = (toks + list(ev.token_ids), lps + list(ev.logprobs),
                                  ev.finish or fin)
        steps += 1
        assert steps < 5000
    assert runner.stats().running == 0 and runner.alloc.stats().used == 0
    stop = set(runner_backend.info.stop_token_ids)
    for i, (ids, params, kind) in reqs.items():
        toks, lps, fin = out[i]
        alone = list(fast_backend.stream(ids, params))
        assert toks == [int(t) for t in alone], (i, kind)
        if params.logprobs is not None:
            assert [lp.token_id for lp in lps] == toks
            for a, b in zip(lps, alone):
                assert a.logprob == pytest.approx(b.logprob.logprob, abs=1e-3)
                assert len(a.top) <= params.logprobs
        else:
            assert lps == []
        if kind:
            assert fin == "stop" and toks[-1] in stop
            check_reply(kind, tiny_tokenizer.decode(toks[:-1]))
        else:
            assert fin == "length" and len(toks) == params.max_new_tokens


def test_a_bad_grammar_fails_only_its_request(runner_backend, tiny_tokenizer):
    runner = batch_runner_for(runner_backend)
    ids = prompt(tiny_tokenizer)
    runner.add(1, ids, SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
    runner.add(2, ids, SamplingParams(max_new_tokens=5, grammar=Grammar("json_schema", "{")))
    evs = []
    while runner.has_work():
        evs += runner.step()
    fails = [e for e in evs if e.finish == "error"]
    assert [e.request_id for e in fails] == [2] and "not valid JSON" in fails[0].error
    assert sum(len(e.token_ids) for e in evs if e.request_id == 1) == 5


def test_a_constrained_row_chains_with_its_mask_from_the_token_before(tiny_tokenizer):
    """A constrained row chains like the others: each chained step's tokens are picked once
    the step before is read back, with the mask its grammar gives after that token; the
    constrained reply obeys its grammar and the greedy row keeps its tokens."""
    from test_scheduler import _ChainFake

    from qwen_trt.serving.scheduler import BatchRunner, SchedulerConfig

    class Book:
        def constraint(self, grammar, max_new_tokens):
            return _EvenOnly(max_new_tokens)

    fake = _ChainFake()
    runner = BatchRunner(fake, SchedulerConfig(max_batch=4, token_budget=16),
                         grammars=lambda: Book())
    runner.add(0, [1, 2, 3], SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))
    runner.add(1, [4, 5], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True,
                                         grammar=Grammar("json_object")))
    out = {0: [], 1: []}
    chained_while_constrained = 0
    while runner.has_work():
        before = runner.chained_steps
        constrained = any(s.rid == 1 for s in runner._running)
        for ev in runner.step():
            out[ev.request_id] += ev.token_ids
        if constrained and 1 in runner._seqs:
            chained_while_constrained += runner.chained_steps - before
    assert chained_while_constrained > 5
    assert len(out[1]) == 12 and all(t % 2 == 0 for t in out[1])
    ref, t, p = [], 3, 2
    for _ in range(30):
        t = _ChainFake.f(t, p)
        ref.append(t)
        p += 1
    assert out[0] == ref


class _EvenOnly:
    """A stand-in constraint over the fake's 64-token vocabulary: even ids only."""

    def __init__(self, max_new_tokens):
        self.generated = 0

    def fill(self, out):
        out.fill_(0x55555555)
        return out

    def accept(self, tok):
        self.generated += 1
        return tok % 2 == 0


def test_a_backend_that_cannot_constrain_says_so_in_one_line(tiny_tokenizer):
    from fakes import ScriptedBackend

    from qwen_trt.backends.base import UnsupportedRequestError

    backend = ScriptedBackend(tiny_tokenizer, "not JSON")
    for params in (SamplingParams(grammar=GRAMMARS["json_object"]), SamplingParams(logprobs=2)):
        with pytest.raises(UnsupportedRequestError) as e:
            list(ReplyStream(backend, [1, 2], params))
        assert "\n" not in str(e.value) and "scripted" in str(e.value)
    assert "".join(ReplyStream(backend, [1, 2], SamplingParams())) == "not JSON"


@pytest.mark.parametrize("kind, budget", [("tool_calls_parallel", 100), ("json_schema", 64),
                                          ("json_object", 12)])
def test_sampled_replies_end_complete_within_tight_budgets(tiny_backend, tiny_tokenizer, kind,
                                                           budget):
    """Another parallel call, another key or a long string would not fit: the constraint
    ends the reply in time, for every seed."""
    for seed in range(6):
        params = SamplingParams(max_new_tokens=budget, temperature=1.5, top_k=0, top_p=1.0,
                                seed=seed, grammar=GRAMMARS[kind])
        reply, _ = run(tiny_backend, prompt(tiny_tokenizer, f"seed {seed}"), params)
        assert reply.metrics.finish_reason == "stop", (seed, reply.text)
        check_reply(kind, reply.text)


def test_a_constraint_ends_in_time_whatever_is_picked(tiny_tokenizer):
    """Uniform picks among the allowed tokens (the worst model): a parallel tool call reply
    still ends complete within its budget, for every seed (another call is not begun when it
    could not finish)."""
    import random

    from qwen_trt.fast.step.grammar import GrammarBook

    stop = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    book = GrammarBook(tiny_tokenizer, len(tiny_tokenizer), (stop,))
    bits = torch.arange(32, dtype=torch.int32)
    tools = [{"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}, {"name": "noop", "parameters": {"type": "object"}}]
    grammar = Grammar("tool_calls", json.dumps({"tools": tools, "parallel": True}))
    for seed in range(60):
        rng = random.Random(seed)
        c = book.constraint(grammar, 96)
        out = []
        for _ in range(96):
            allowed = ((c.fill().unsqueeze(-1) >> bits) & 1).flatten().nonzero().flatten()
            tok = int(allowed[rng.randrange(len(allowed))])
            assert c.accept(tok)
            if tok == stop:
                break
            out.append(tok)
        assert tok == stop, (seed, tiny_tokenizer.decode(out))
        for block in CALL.findall(tiny_tokenizer.decode(out)):
            call = json.loads(block)
            jsonschema.validate(call["arguments"], tools[call["name"] == "noop"]["parameters"])


def test_the_constrained_bench_runs_on_cpu(tiny_model_dir):
    from qwen_trt.bench.constrained import run as bench

    out = bench(str(tiny_model_dir), streams=2, new_tokens=12, prompt_len=16, device="cpu",
                log=lambda line: None)
    assert all(v is not None for v in out["summary"].values()), out["summary"]
    assert len(out["streams_one_constrained"]["per_stream_tok_s"]) == 2
    assert out["streams_plain"]["tokens"] == 24 and out["streams_logprobs"]["tokens"] == 24


def test_frequency_penalty_reaches_every_path(tiny_backend, fast_backend, runner_backend,
                                              tiny_tokenizer):
    """Greedy random weights repeat themselves; a frequency penalty makes them repeat less,
    the same way on the HF backend, the batch-1 decoder and the batched runner."""
    from collections import Counter

    ids = prompt(tiny_tokenizer, "The quick brown fox")
    plain = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)
    pen = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True,
                         frequency_penalty=2.0)
    a = list(tiny_backend.stream(ids, plain))
    b = list(tiny_backend.stream(ids, pen))
    assert max(Counter(b).values()) < max(Counter(a).values())
    assert list(fast_backend.stream(ids, pen)) == b
    assert list(runner_backend.stream(ids, pen)) == b
