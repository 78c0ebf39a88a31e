"""Speculative decoding on CPU (tiny model, float32, eager): verify rows in the batched runner.

Greedy requests give exactly the tokens they give without speculation (n-gram drafts, mixed
speculative and plain rows in one batch, stops and max_tokens inside an accepted run, logprobs
of the emitted tokens); sampled requests keep every sampler feature; the adaptive rule drafts
nothing where nothing is accepted."""
from __future__ import annotations

import random

import pytest
import torch

from qwen_trt.fast import TINY, build_model
from qwen_trt.fast.model.weights import init_random
from qwen_trt.fast.step.batched import BatchedModel
from qwen_trt.params import SamplingParams
from qwen_trt.serving.scheduler import BatchRunner, SchedulerConfig
from qwen_trt.serving.speculation import SpecConfig, auto_tokens, expected_tokens

MAX_SEQ = 256


pytestmark = pytest.mark.usefixtures("one_thread")     # conftest: tiny tensor work


def weights_for(std):
    m = build_model(TINY, max_seq_len=MAX_SEQ, dtype=torch.float32, device="cpu")
    init_random(m, seed=3, std=std)
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.fixture(scope="module")
def varied():
    return weights_for(0.5)      # continuations vary: drafts often fail


@pytest.fixture(scope="module")
def repetitive():
    return weights_for(0.02)     # continuations repeat: n-gram drafts are accepted


def runner_for(weights, spec=None, max_batch=8):
    m = build_model(TINY, max_seq_len=MAX_SEQ, dtype=torch.float32, device="cpu")
    m.load_state_dict(weights, strict=False)
    bm = BatchedModel(m, num_blocks=200, block_size=16)
    cfg = SchedulerConfig(max_batch=max_batch, token_budget=256,
                          speculative=spec or SpecConfig())
    return BatchRunner(bm, cfg)


def drive(runner, reqs):
    out = {i: [] for i in reqs}
    lps = {i: [] for i in reqs}
    fin = {}
    for i, (p, sp) in reqs.items():
        runner.add(i, p, sp)
    steps = 0
    while runner.has_work():
        for ev in runner.step():
            out[ev.request_id] += ev.token_ids
            lps[ev.request_id] += [(lp.token_id, round(lp.logprob, 4)) for lp in ev.logprobs]
            if ev.finish:
                fin[ev.request_id] = ev.finish
        steps += 1
        assert steps < 5000
    return out, lps, fin, steps


def prompts(k, seed, repeat=True):
    rng = random.Random(seed)
    out = []
    for _ in range(k):
        base = [rng.randrange(1, TINY.vocab_size) for _ in range(rng.randrange(3, 12))]
        out.append(base * rng.randrange(2, 5) if repeat else base + base[:3])
    return out


@pytest.mark.parametrize("which", ["varied", "repetitive"])
def test_greedy_tokens_equal_without_speculation(which, request):
    """56 prompts, 8 at a time, speculative and plain rows mixed in one batch (a third of the
    requests have penalties or logprobs, which draft through the general path), stops and
    max_tokens landing inside accepted runs: the same tokens, logprobs and finishes."""
    w = request.getfixturevalue(which)
    ps = prompts(56, seed=11)
    rng = random.Random(2)
    reqs = {}
    for i, p in enumerate(ps):
        kw = {}
        if i % 3 == 1:
            kw["logprobs"] = 2
        if i % 5 == 2:
            kw["repetition_penalty"] = 1.2
        stop = (rng.randrange(1, TINY.vocab_size),) if i % 4 == 0 else ()
        reqs[i] = (p, SamplingParams(max_new_tokens=rng.randrange(1, 40), temperature=0,
                                     stop_token_ids=stop, ignore_eos=not stop, **kw))
    plain = drive(runner_for(w), reqs)
    spec_runner = runner_for(w, SpecConfig("ngram"))
    spec = drive(spec_runner, reqs)
    assert spec[0] == plain[0]
    assert spec[2] == plain[2]
    # logprobs of the emitted tokens: the same tokens, values up to float32 rounding between
    # a k+1-row and a 1-row step
    for i in reqs:
        assert [t for t, _ in spec[1][i]] == [t for t, _ in plain[1][i]]
        assert all(abs(x - y) < 1e-3 for (_, x), (_, y) in zip(spec[1][i], plain[1][i]))
    c = spec_runner.stats().extra["spec_decode"]
    assert c["drafts"] > 0
    if which == "repetitive":
        assert c["accepted_tokens"] > 0.5 * c["draft_tokens"] > 0
        assert spec[3] < plain[3]          # fewer steps: several tokens a step
    assert spec_runner.stats().kv_blocks_used == 0


def test_fixed_draft_count_and_a_verify_step_emitting_several_tokens(repetitive):
    """--num-speculative-tokens 4 on repetitive output: verify steps emit up to 5 tokens,
    the events carry them together, and the totals are right."""
    ps = prompts(4, seed=3)
    reqs = {i: (p, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True))
            for i, p in enumerate(ps)}
    r = runner_for(repetitive, SpecConfig("ngram", num_tokens=4))
    seen_multi = []
    for i, (p, sp) in reqs.items():
        r.add(i, p, sp)
    out = {i: [] for i in reqs}
    while r.has_work():
        for ev in r.step():
            out[ev.request_id] += ev.token_ids
            seen_multi.append(len(ev.token_ids))
    assert max(seen_multi) == 5
    assert all(len(v) == 30 for v in out.values())
    assert out == drive(runner_for(repetitive), reqs)[0]
    c = r.stats().extra["spec_decode"]
    assert c["accepted_per_pos"][0] >= c["accepted_per_pos"][3] > 0


def test_sampled_rows_with_speculation_keep_their_settings(repetitive):
    """Sampled rows verify drafts by rejection sampling: seeded runs repeat exactly, top_k=1
    (greedy by the filter) equals greedy decoding, and the lengths and stops hold."""
    ps = prompts(6, seed=8)
    reqs = {i: (p, SamplingParams(max_new_tokens=25, temperature=0.8, top_k=1, seed=i,
                                  ignore_eos=True)) for i, p in enumerate(ps)}
    greedy = {i: (p, SamplingParams(max_new_tokens=25, temperature=0, ignore_eos=True))
              for i, p in enumerate(ps)}
    a = drive(runner_for(repetitive, SpecConfig("ngram")), reqs)[0]
    assert a == drive(runner_for(repetitive), greedy)[0]
    sampled = {i: (p, SamplingParams(max_new_tokens=25, temperature=1.0, top_p=0.9, seed=i,
                                     presence_penalty=0.5, ignore_eos=True))
               for i, p in enumerate(ps)}
    x = drive(runner_for(repetitive, SpecConfig("ngram")), sampled)[0]
    y = drive(runner_for(repetitive, SpecConfig("ngram")), sampled)[0]
    assert x == y and all(len(v) == 25 for v in x.values())


def test_the_adaptive_rule_drafts_less_as_acceptance_falls_and_the_batch_fills():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 3) == 4.0
    assert auto_tokens(0.05, 1) == 0                 # nothing accepted: no drafting
    assert auto_tokens(0.8, 1) >= 3
    assert auto_tokens(0.8, 64) < auto_tokens(0.8, 1)
    assert auto_tokens(0.3, 128) == 0


def test_bad_speculative_settings_are_one_line():
    with pytest.raises(ValueError, match="one of off, ngram"):
        SpecConfig("eagle")
    with pytest.raises(ValueError, match="from 1 to 8"):
        SpecConfig("ngram", num_tokens=0)


def test_the_speculative_bench_measures_against_off_and_real_acceptance_is_exact():
    """bench.speculative on the tiny shape: every tau row beside off in the same process, the
    measured tau rising with the set one, and (float32 on CPU) real acceptance of the off run's
    own continuation reproduces it exactly with nearly every draft accepted."""
    from qwen_trt.bench.speculative import SpecBenchConfig, run_spec_bench, rate_for

    assert abs(expected_tokens(rate_for(3.0, 4), 4) - 3.0) < 1e-6
    res = run_spec_bench(SpecBenchConfig(shape="tiny", device="cpu", concurrency=(2,),
                                         taus=(1.0, 4.0), prompt_len=24, new_tokens=40,
                                         num_tokens=4), log=lambda m: None)
    row = res["results"]["2"]
    assert row["off"]["tokens_ok"] and row["tau=4"]["tokens_ok"]
    assert row["tau=1"]["tau_measured"] in (None, 1.0)
    assert row["tau=4"]["tau_measured"] > 2.5
    agree = row["agreement"]
    assert agree["identical_replies"] == agree["replies"] == 2
    assert agree["tau_measured"] > 4.0


@pytest.fixture(scope="module")
def eagle_target(tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint as the target (its own weights) and a random EAGLE-3 draft for it
    in both published layouts."""
    from qwen_trt.fast.model.config import FastConfig
    from qwen_trt.fast.model.weights import load_safetensors
    from qwen_trt.model.tiny_draft import write_tiny_draft
    import json

    cfg = FastConfig.from_hf(json.loads((tiny_model_dir / "config.json").read_text()))
    drafts = {lay: str(write_tiny_draft(tmp_path_factory.mktemp(f"draft-{lay}"), tiny_model_dir,
                                        layout=lay)) for lay in ("sglang", "speculators")}
    return cfg, tiny_model_dir, drafts


def eagle_runner(eagle_target, layout=None, max_batch=4, k=3):
    from qwen_trt.fast.loader import build_model
    from qwen_trt.fast.model.weights import load_safetensors
    from qwen_trt.serving.scheduler import make_batch_runner

    cfg, folder, drafts = eagle_target
    m = build_model(cfg, max_seq_len=MAX_SEQ, dtype=torch.float32, device="cpu")
    load_safetensors(m, folder)
    spec = SpecConfig("eagle3", k, draft=drafts[layout]) if layout else SpecConfig()
    return make_batch_runner(m, SchedulerConfig(max_batch=max_batch, token_budget=64,
                                                speculative=spec), kv_tokens=4096)


@pytest.mark.parametrize("layout", ["sglang", "speculators"])
def test_eagle3_drafts_verify_to_the_tokens_of_plain_greedy(eagle_target, layout):
    """EAGLE-3 in the runner, both layouts: the target's aux hidden states feed the draft,
    which catches up after every step (prefill chunks of 64-token budgets, verify rows) and
    drafts the next step; greedy tokens equal plain decoding's, mixed with sampled rows."""
    rng = random.Random(4)
    vocab = eagle_target[0].vocab_size
    reqs = {i: ([rng.randrange(1, vocab) for _ in range(rng.randrange(5, 90))],
                SamplingParams(max_new_tokens=rng.randrange(5, 30), temperature=0,
                               ignore_eos=True)) for i in range(10)}
    plain = drive(eagle_runner(eagle_target), reqs)[0]
    r = eagle_runner(eagle_target, layout)
    got = drive(r, reqs)[0]
    assert got == plain
    c = r.stats().extra["spec_decode"]
    assert c["drafts"] > 0 and c["draft_tokens"] >= c["drafts"]


def test_a_draft_that_does_not_fit_the_target_is_one_line(eagle_target, tmp_path):
    import json
    import shutil

    from qwen_trt.errors import QwenTrtError

    cfg, folder, drafts = eagle_target
    bad = tmp_path / "bad"
    shutil.copytree(drafts["sglang"], bad)
    c = json.loads((bad / "config.json").read_text())
    c["hidden_size"] = c["hidden_size"] * 2
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises((QwenTrtError, ValueError)) as e:
        eagle_runner((cfg, folder, {"sglang": str(bad)}), "sglang")
    assert "\n" not in str(e.value) and "hidden" in str(e.value)


def test_the_reply_footer_shows_tokens_per_step_when_drafts_were_accepted():
    from qwen_trt.params import Reply, ReplyMetrics
    from qwen_trt.ui.text import reply_footer

    m = ReplyMetrics(ttft_ms=9.0, tokens=90, decode_tok_s=800.0, finish_reason="stop", steps=30)
    assert "3.00 tokens/step" in reply_footer(Reply("x", m))
    one = ReplyMetrics(ttft_ms=9.0, tokens=90, decode_tok_s=400.0, finish_reason="stop", steps=90)
    assert "tokens/step" not in reply_footer(Reply("x", one))
    assert "tokens/step" not in reply_footer(Reply("x", ReplyMetrics(tokens=5)))


def test_a_predicted_output_drafts_with_speculation_off(repetitive, varied):
    """OpenAI's prediction: its tokens are the drafts (speculation off otherwise). A correct
    prediction gives the same greedy tokens in far fewer steps; a wrong one the same tokens too
    (exact acceptance)."""
    ps = prompts(4, seed=21, repeat=False)
    for w in (varied, repetitive):
        reqs = {i: (p, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))
                for i, p in enumerate(ps)}
        plain, _, _, plain_steps = drive(runner_for(w), reqs)
        right = {i: (p, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True,
                                       prediction=tuple(plain[i]))) for i, p in enumerate(ps)}
        r = runner_for(w)
        got, _, _, steps = drive(r, right)
        assert got == plain and steps < plain_steps / 2
        assert r.stats().extra["spec_decode"]["accepted_tokens"] > 100
        wrong = {i: (p, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True,
                                       prediction=tuple(t % 50 + 3 for t in plain[i])))
                 for i, p in enumerate(ps)}
        assert drive(runner_for(w), wrong)[0] == plain


def test_prediction_parsing_and_usage_counts():
    from qwen_trt.api.errors import ApiError
    from qwen_trt.api.protocol import parse_prediction, prediction_counts, usage

    assert parse_prediction(None) is None and parse_prediction({}) is None
    assert parse_prediction({"type": "content", "content": "abc"}) == "abc"
    assert parse_prediction({"type": "content", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}) == "ab"
    for bad in ("x", {"type": "text", "content": "a"}, {"type": "content"},
                {"type": "content", "content": 3},
                {"type": "content", "content": [{"type": "image_url"}]},
                {"type": "content", "content": "\ud800"}):
        with pytest.raises(ApiError) as e:
            parse_prediction(bad)
        assert e.value.status == 400 and "prediction" in str(e.value)
    assert prediction_counts([1, 2, 3, 4], [1, 2, 9, 3, 4]) == (4, 0)
    assert prediction_counts([1, 2, 3, 4], [7, 8]) == (0, 4)
    u = usage(10, 5, None, (3, 1))
    assert u["completion_tokens_details"] == {"accepted_prediction_tokens": 3,
                                              "rejected_prediction_tokens": 1}


def test_metrics_show_the_speculative_counters_under_both_names():
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from qwen_trt.api.metrics import ServerMetrics

    spec = {"drafts": 7, "draft_tokens": 20, "accepted_tokens": 12,
            "accepted_per_pos": [6, 4, 2, 0, 0, 0, 0, 0]}
    st = SimpleNamespace(runner={"extra": {"spec_decode": spec}})
    text = generate_latest(ServerMetrics(lambda: st, lambda: 0, lambda: 0,
                                         model_name="m").registry).decode()
    assert "qwen_trt_spec_decode_num_accepted_tokens_total 12.0" in text
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 7.0' in text
    assert 'qwen_trt_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4.0' in text
    plain = generate_latest(ServerMetrics(lambda: SimpleNamespace(runner={}), lambda: 0,
                                          lambda: 0).registry).decode()
    assert "spec_decode" not in plain


def test_logit_bias_moves_the_sampler_and_is_checked_in_one_line(varied):
    """logit_bias on the device with the penalties: +100 on one token makes greedy pick it at
    every step, on the batched runner (chained and verify paths alike) and in the sampler;
    bad biases are one-line 400s."""
    from qwen_trt.api.errors import ApiError
    from qwen_trt.api.protocol import parse_logit_bias

    ps = prompts(3, seed=5)
    for spec in (SpecConfig(), SpecConfig("ngram")):
        reqs = {i: (p, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True,
                                      logit_bias=((17, 100.0),))) for i, p in enumerate(ps)}
        out = drive(runner_for(varied, spec), reqs)[0]
        assert all(v == [17] * 12 for v in out.values())
        ban = {i: (p, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
               for i, p in enumerate(ps)}
        plain = drive(runner_for(varied, spec), ban)[0]
        first = plain[0][0]
        banned = {0: (ps[0], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True,
                                            logit_bias=((first, -100.0),)))}
        assert first not in drive(runner_for(varied, spec), banned)[0][0]
    assert parse_logit_bias({"5": 3, "2": -100}) == ((2, -100.0), (5, 3.0))
    for bad in ({"x": 1}, {"5": 101}, {"5": True}, [1], {"-1": 2}):
        with pytest.raises(ApiError) as e:
            parse_logit_bias(bad)
        assert e.value.status == 400 and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((3, 200.0),))
