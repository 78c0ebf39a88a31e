"""Continuous batching on CPU (tiny shapes, float32, eager): the batched runner produces the same
tokens as the batch-1 decoder, alone or batched with others, with or without prefix reuse,
after cancels and preemptions; it respects the token budget and frees the KV."""
from __future__ import annotations

import random

import pytest
import torch

from qwen_trt.fast import TINY, FastDecoder, build_model
from qwen_trt.fast.step.batched import BatchedModel
from qwen_trt.fast.model.weights import init_random
from qwen_trt.params import SamplingParams
from qwen_trt.backends.runner import generate
from qwen_trt.serving.scheduler import BatchRunner, SchedulerConfig

MAX_SEQ = 256


pytestmark = pytest.mark.usefixtures("one_thread")     # conftest: tiny tensor work


@pytest.fixture(scope="module")
def weights():
    # std 0.5: the tiny random model's greedy continuations vary (std 0.02 repeats one token)
    m = build_model(TINY, max_seq_len=MAX_SEQ, dtype=torch.float32, device="cpu")
    init_random(m, seed=1, std=0.5)
    return {k: v.clone() for k, v in m.state_dict().items()}


def fresh_model(weights):
    m = build_model(TINY, max_seq_len=MAX_SEQ, dtype=torch.float32, device="cpu")
    m.load_state_dict(weights, strict=False)
    return m


def make_runner(weights, *, blocks=128, block_size=16, **kw) -> BatchRunner:
    bm = BatchedModel(fresh_model(weights), num_blocks=blocks, block_size=block_size)
    return BatchRunner(bm, SchedulerConfig(**kw))


def greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


def prompts(k, seed=0, lo=3, hi=90):
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY.vocab_size) for _ in range(rng.randrange(lo, hi))]
            for _ in range(k)]


def run_all(runner, reqs, arrivals=None, abort_at=None):
    """Drive the runner like the worker does; returns {rid: (tokens, finish, cached)}."""
    out = {rid: ([], None, None) for rid in reqs}
    arrivals = arrivals or {rid: 0 for rid in reqs}
    step = 0
    pending = dict(reqs)
    while pending or runner.has_work():
        for rid in [r for r in pending if arrivals[r] <= step]:
            runner.add(rid, *pending.pop(rid))
        if abort_at and step in abort_at:
            runner.abort(abort_at[step])
        for ev in runner.step():
            toks, fin, cached = out[ev.request_id]
            out[ev.request_id] = (toks + list(ev.token_ids), ev.finish or fin,
                                  ev.cached_tokens if cached is None else cached)
        assert runner.last_step_tokens <= runner.config.token_budget
        step += 1
        assert step < 10_000
    return out


def alone(weights, prompt, params):
    return list(generate(make_runner(weights, prefix_caching=False), prompt, params))


def test_alone_matches_the_batch1_decoder(weights):
    dec = FastDecoder(fresh_model(weights))
    for p in prompts(3, seed=5):
        ref = list(dec.generate(p, greedy(40)))
        assert len(set(ref)) > 5                      # a varied continuation, not one token
        assert alone(weights, p, greedy(40)) == ref


def test_batched_with_seven_others_is_identical(weights):
    ps = prompts(8, seed=1)
    ref = {i: alone(weights, p, greedy(30)) for i, p in enumerate(ps)}
    runner = make_runner(weights, max_batch=8, token_budget=64)  # forces chunked prefill
    out = run_all(runner, {i: (p, greedy(30)) for i, p in enumerate(ps)})
    for i in ref:
        assert out[i][0] == ref[i] and out[i][1] == "length"
    # staggered arrivals: newcomers join running batches at step boundaries
    runner = make_runner(weights, max_batch=8, token_budget=64)
    out = run_all(runner, {i: (p, greedy(30)) for i, p in enumerate(ps)},
                  arrivals={i: 3 * i for i in range(8)})
    assert all(out[i][0] == ref[i] for i in ref)
    assert runner.stats().kv_blocks_used == 0


def test_max_batch_caps_running_sequences(weights):
    runner = make_runner(weights, max_batch=3, token_budget=64)
    for i, p in enumerate(prompts(6, seed=2)):
        runner.add(i, p, greedy(5))
    seen = 0
    while runner.has_work():
        runner.step()
        seen = max(seen, runner.stats().running)
    assert seen == 3


def test_prefix_reuse_gives_the_same_tokens_and_reports_cached(weights):
    turn1 = prompts(1, seed=3, lo=70, hi=71)[0]
    on = make_runner(weights, prefix_caching=True)
    off = make_runner(weights, prefix_caching=False)
    r1 = list(generate(on, turn1, greedy(20)))
    assert r1 == list(generate(off, turn1, greedy(20)))
    turn2 = turn1 + r1 + prompts(1, seed=4, lo=10, hi=11)[0]   # history + reply ids + new turn
    a = run_all(on, {7: (turn2, greedy(20))})[7]
    b = run_all(off, {7: (turn2, greedy(20))})[7]
    assert a[0] == b[0]
    assert a[2] == (len(turn1) + len(r1)) // 16 * 16           # every full block of turn 1
    assert b[2] == 0
    assert on.stats().prefix_hit_tokens == a[2]


def test_identical_prompts_in_flight_prefill_once(weights):
    """n > 1: four copies of one prompt arriving together; the first prefills it, the others
    wait a step and take its full blocks from the prefix cache. Tokens as if alone."""
    p = prompts(1, seed=8, lo=70, hi=71)[0]
    reqs = {i: (p, SamplingParams(max_new_tokens=12, temperature=0.8, seed=i, ignore_eos=True))
            for i in range(4)}
    runner = make_runner(weights)
    out = run_all(runner, reqs)
    assert runner.stats().prefix_hit_tokens == 3 * ((len(p) - 1) // 16 * 16)
    for i, (prompt, params) in reqs.items():
        assert out[i][0] == alone(weights, prompt, params) and out[i][1] == "length"
        assert out[i][2] == (0 if i == 0 else 64)


def test_cancel_mid_batch_frees_kv_and_spares_the_others(weights):
    ps = prompts(4, seed=6)
    ref = {i: alone(weights, p, greedy(25)) for i, p in enumerate(ps)}
    runner = make_runner(weights, token_budget=256)
    out = run_all(runner, {i: (p, greedy(25)) for i, p in enumerate(ps)}, abort_at={6: 2})
    assert out[2][1] == "cancelled" and 0 < len(out[2][0]) < 25
    for i in (0, 1, 3):
        assert out[i][0] == ref[i]
    st = runner.stats()
    assert st.kv_blocks_used == 0 and st.running == 0 and st.waiting == 0
    runner.abort(12345)                                         # unknown id: ignored


def test_long_prompt_is_chunked_and_decodes_keep_going(weights):
    runner = make_runner(weights, token_budget=32, max_batch=4)
    short, long_ = prompts(1, seed=7, lo=8, hi=9)[0], prompts(1, seed=8, lo=200, hi=201)[0]
    runner.add(0, short, greedy(60))
    got = {0: 0, 1: 0}
    first_long = None
    for step in range(200):
        if step == 3:
            runner.add(1, long_, greedy(3))
        evs = runner.step()
        ids = {ev.request_id for ev in evs}
        if 3 <= step and got[0] < 60:
            assert 0 in ids, f"the running stream got no token at step {step}"
        for ev in evs:
            got[ev.request_id] += len(ev.token_ids)
            if ev.request_id == 1 and first_long is None:
                first_long = step
        if not runner.has_work():
            break
    # 200 prompt tokens at most 31 per step (one decode row takes the rest of the budget)
    assert first_long - 3 + 1 >= 200 / 31
    assert runner.max_step_tokens <= 32 and got == {0: 60, 1: 3}


def test_preemption_under_kv_pressure_keeps_outputs(weights):
    ps = prompts(4, seed=9, lo=30, hi=40)
    ref = {i: alone(weights, p, greedy(40)) for i, p in enumerate(ps)}
    runner = make_runner(weights, blocks=13, block_size=16, token_budget=128)  # 12 usable
    out = run_all(runner, {i: (p, greedy(40)) for i, p in enumerate(ps)})
    assert runner.policy.preemptions > 0 and runner.stats().extra["preemptions"] > 0
    for i in ref:
        assert out[i][0] == ref[i]
    assert runner.stats().kv_blocks_used == 0


def test_sampling_per_row_is_seeded_and_independent_of_the_batch(weights):
    p = prompts(2, seed=10)
    sp = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, top_k=40, seed=123)
    solo = alone(weights, p[0], sp)
    assert solo == alone(weights, p[0], sp)
    runner = make_runner(weights)
    mixed = run_all(runner, {0: (p[0], sp), 1: (p[1], greedy(20)),
                             2: (p[1], SamplingParams(max_new_tokens=20, top_k=0, seed=5))})
    assert mixed[0][0] == solo
    assert mixed[1][0] == alone(weights, p[1], greedy(20))
    assert alone(weights, p[1], SamplingParams(max_new_tokens=20, top_k=1, seed=9)) == \
        mixed[1][0]


def test_sampling_matches_the_batch1_decoder_seed_for_seed(weights):
    """One sampler for both paths: the same seed gives the same tokens, penalties included."""
    dec = FastDecoder(fresh_model(weights))
    p = prompts(2, seed=12)
    for sp in (SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, top_k=30, seed=7,
                              ignore_eos=True),
               SamplingParams(max_new_tokens=24, temperature=1.0, top_k=0, seed=8,
                              repetition_penalty=1.3, presence_penalty=0.5, ignore_eos=True)):
        ref = list(dec.generate(p[0], sp))
        runner = make_runner(weights)
        out = run_all(runner, {0: (p[0], sp), 1: (p[1], greedy(24))})
        assert out[0][0] == ref


def test_stop_ids_and_errors(weights):
    p = prompts(1, seed=11)[0]
    toks = alone(weights, p, greedy(30))
    stop = toks[7]
    first = toks.index(stop)
    runner = make_runner(weights)
    out = run_all(runner, {0: (p, SamplingParams(max_new_tokens=30, temperature=0,
                                                  stop_token_ids=(stop,)))})
    assert out[0] == (toks[:first + 1], "stop", 0)
    # the backend's stop ids apply to every request, unless it ignores EOS
    bm = BatchedModel(fresh_model(weights), num_blocks=64, block_size=16)
    with_default = BatchRunner(bm, SchedulerConfig(), stop_ids=(stop,))
    out = run_all(with_default, {0: (p, SamplingParams(max_new_tokens=30, temperature=0)),
                                 1: (p, greedy(30))})
    assert out[0][:2] == (toks[:first + 1], "stop") and out[1][:2] == (toks, "length")
    runner.add(1, [], greedy(3))
    runner.add(2, p, greedy(MAX_SEQ))
    evs = runner.step()
    assert [(e.request_id, e.finish) for e in evs] == [(1, "error"), (2, "error")]
    assert "limit" in evs[1].error and "\n" not in evs[1].error
    with pytest.raises(ValueError):
        runner.add(3, p, greedy(2))
        runner.add(3, p, greedy(2))


def test_fast_backend_hands_its_weights_to_the_runner(tiny_model_dir):
    from qwen_trt.backends.fast_backend import FastBackend
    from qwen_trt.serving.scheduler import BatchRunner, batch_runner_for

    backend = FastBackend.load(str(tiny_model_dir), device="cpu", max_seq_len=128, warmup=False)
    ids = [3, 9, 27, 81, 243]
    before = list(backend.stream(ids, greedy(12)))
    runner = batch_runner_for(backend, SchedulerConfig(max_batch=4, token_budget=64),
                              kv_tokens=512)
    assert isinstance(runner, BatchRunner) and runner is batch_runner_for(backend)
    from qwen_trt.serving.worker import make_runner

    assert make_runner(backend) is runner                        # what the worker process runs
    assert runner.max_concurrency == 4
    assert list(backend.stream(ids, greedy(12))) == before       # stream now via the runner
    assert runner.stats().kv_blocks_total == 512 // 32


class _ChainFake:
    """A stand-in model with the chained-decode interface (what the CUDA graphs do: the step
    picks its next token and advances on the device), so CPU CI checks the scheduler's
    bookkeeping of steps launched before their tokens are read."""

    V = 50
    block_size = 4
    max_seq_len = 512
    device = torch.device("cpu")

    class cfg:  # noqa: N801 - attribute bag
        vocab_size = 50

    class cache:  # noqa: N801 - attribute bag
        num_blocks = 200

    @staticmethod
    def f(prev, pos):
        return (prev * 7 + pos * 3 + 1) % _ChainFake.V

    def __init__(self, chain=True):
        self.state, self.n, self.res, self.launched = None, 0, {}, 0
        self.chain, self.logits = chain, None

    def _logits(self, toks, pos):
        out = torch.full((len(toks), self.V), -1.0)
        for i, (t, p) in enumerate(zip(toks, pos)):
            out[i, self.f(t, p)] = 1.0
        return out

    def forward(self, toks, pos, chunks, rows):
        return self._logits([toks[r] for r in rows], [pos[r] for r in rows])

    def decode(self, toks, pos, tables):
        return self._logits(toks, pos)

    def can_chain(self, b):
        return self.chain

    # the chained decode as BatchedModel runs it: launch/chain compute the logits of the step
    # from the inputs on the "device" (state), emit picks the tokens that become the next inputs
    def decode_launch(self, toks, pos, tables):
        self.state = (list(toks), list(pos))
        self._step()

    def decode_chain(self, b, grown):
        self._step()

    def _step(self):
        toks, pos = self.state
        self.logits = self._logits(toks, pos)
        self.state = (None, [p + 1 for p in pos])
        self.launched += 1

    def decode_logits(self, b):
        return self.logits

    def decode_emit(self, b, tokens=None):
        nxt = (tokens if tokens is not None else self.logits.argmax(-1)).tolist()
        self.state = (nxt, self.state[1])
        self.n += 1
        self.res[self.n] = nxt
        return self.n

    def decode_result(self, h):
        return self.res.pop(h)


def test_chained_greedy_steps_keep_tokens_stops_and_aborts_right():
    def ref(prompt, n, stop):
        out, t, p = [], prompt[-1], len(prompt) - 1
        for _ in range(n):
            t = _ChainFake.f(t, p)
            out.append(t)
            p += 1
            if t in stop:
                break
        return out

    rng = random.Random(0)
    fake = _ChainFake()
    runner = BatchRunner(fake, SchedulerConfig(max_batch=4, token_budget=16))
    reqs = {i: ([rng.randrange(50) for _ in range(rng.randrange(2, 30))], rng.randrange(1, 40),
                (rng.randrange(50),) if i % 3 == 0 else ()) for i in range(10)}
    out, fin = {i: [] for i in reqs}, {}
    pending, step = dict(reqs), 0
    while pending or runner.has_work():
        for i in [k for k in pending if k * 5 <= step]:
            p, n, stop = pending.pop(i)
            runner.add(i, p, SamplingParams(max_new_tokens=n, temperature=0,
                                            stop_token_ids=stop, ignore_eos=not stop))
        if step == 30:
            runner.abort(4)
        for ev in runner.step():
            out[ev.request_id] += ev.token_ids
            if ev.finish:
                fin[ev.request_id] = ev.finish
        step += 1
        assert step < 2000
    assert runner.chained_steps > 5
    for i, (p, n, stop) in reqs.items():
        if i == 4:
            assert fin[4] == "cancelled"
            continue
        assert out[i] == ref(p, n, stop), i
        assert fin[i] == ("stop" if out[i][-1] in stop else "length")
    assert runner.stats().kv_blocks_used == 0


def test_the_policy_plans_and_the_plan_is_plain_rows(weights):
    """The runner's parts: the policy (Scheduler) decides a step without launching it, as a
    StepPlan of plain rows (no scheduler objects); the executor computes it (fast/step)."""
    from qwen_trt.fast.step.plan import StepPlan, StepRow
    from qwen_trt.serving.scheduler import Scheduled, Scheduler

    runner = make_runner(weights, max_batch=4, token_budget=40)
    assert isinstance(runner.policy, Scheduler)
    runner.add(1, list(range(3, 12)), greedy(4))          # 9 prompt tokens
    sched = runner.policy.schedule()
    assert isinstance(sched, Scheduled) and isinstance(sched.plan, StepPlan)
    (row,) = sched.plan.rows
    assert type(row) is StepRow and row.rid == 1 and row.tokens == tuple(range(3, 12))
    assert row.start == 0 and row.logits == 1 and row.draft == 0
    toks, pos, logit_rows = sched.plan.flat()
    assert toks == list(range(3, 12)) and pos == list(range(9)) and logit_rows == [8]
    # the plan was only a plan: the runner's own step computes it (and moves on)
    before = runner.steps
    events = runner.step()
    assert runner.steps == before + 1 and [e.request_id for e in events] == [1]


def test_a_plan_of_three_tokens_for_one_sequence_and_one_for_another(weights):
    """The step boundary takes any number of tokens per sequence: a plan holding 3 tokens of
    one sequence (3 logit rows) and 1 of another gives the logits rows and the KV writes of
    decoding them one step at a time."""
    from qwen_trt.fast.step.batched import SeqChunk
    from qwen_trt.fast.step.executor import StepExecutor
    from qwen_trt.fast.step.plan import StepPlan, StepRow
    from qwen_trt.fast.step.sampling import SamplerState

    def setup():
        bm = BatchedModel(fresh_model(weights), num_blocks=32, block_size=16)
        return bm, StepExecutor(bm, SamplerState(MAX_SEQ, TINY.vocab_size, "cpu", rows=2))

    pa, pb = prompts(2, seed=5, lo=20, hi=30)
    ta, tb = tuple(range(1, 4)), tuple(range(4, 7))
    extra_a = [11, 12, 13]                                # a's next three tokens
    # step by step: prefill both prompts, then a's three tokens one at a time, b's one
    bm1, ex1 = setup()
    ex1.run(StepPlan((StepRow(0, tuple(pa), 0, ta, 0), StepRow(1, tuple(pb), 0, tb, 0))))
    ref = [bm1._forward_math([tok], [len(pa) + j], [SeqChunk(0, 1, len(pa) + j + 1, ta)],
                             [0])[0] for j, tok in enumerate(extra_a)]
    ref_b = bm1.decode([21], [len(pb)], [tb])[0].clone()
    # one plan: a's three tokens (all three scored) beside b's one
    bm2, ex2 = setup()
    ex2.run(StepPlan((StepRow(0, tuple(pa), 0, ta, 0), StepRow(1, tuple(pb), 0, tb, 0))))
    plan = StepPlan((StepRow(1, (21,), len(pb), tb, 1),
                     StepRow(0, tuple(extra_a), len(pa), ta, 3)))
    toks, pos, logit_rows = plan.flat()
    assert logit_rows == [0, 1, 2, 3]
    logits = bm2.forward(toks, pos, [SeqChunk(0, 1, len(pb) + 1, tb),
                                     SeqChunk(1, 3, len(pa) + 3, ta)], logit_rows)
    torch.testing.assert_close(logits[0], ref_b, rtol=1e-4, atol=1e-4)
    for j in range(3):
        torch.testing.assert_close(logits[1 + j], ref[j], rtol=1e-4, atol=1e-4)
    # the KV written: every layer, every slot of both sequences, equal
    for layer in range(TINY.layers):
        for c1, c2 in zip(bm1.cache.kv(layer), bm2.cache.kv(layer)):
            torch.testing.assert_close(c1, c2, rtol=1e-4, atol=1e-5)
    # and the executor's output for that plan: b's one token, a's three positions picked
    bm3, ex3 = setup()
    ex3.run(StepPlan((StepRow(0, tuple(pa), 0, ta, 0), StepRow(1, tuple(pb), 0, tb, 0))))
    out = ex3.run(StepPlan((StepRow(1, (21,), len(pb), tb, 1, 1, greedy(8)),
                            StepRow(0, (extra_a[0],) + tuple(extra_a[1:]), len(pa), ta, 3, 0,
                                    greedy(8), draft=2))))
    by = out.by_rid()
    assert by[1].tokens == (int(ref_b.argmax()),)
    best = [int(r.argmax()) for r in ref]
    a = 0
    while a < 2 and extra_a[1 + a] == best[a]:
        a += 1
    assert by[0].accepted == a and by[0].tokens == tuple(extra_a[1:1 + a]) + (best[a],)


def test_sampled_penalized_and_logprob_rows_chain_with_the_tokens_of_step_by_step():
    """Rows that sample (temperature, top-k/top-p, penalties, seeds) or want logprobs chain
    too: the sampler runs behind each chained step on the device. Their tokens and logprobs
    equal the unchained runner's (the same sampler, one step at a time)."""
    def run(chain):
        runner = BatchRunner(_ChainFake(chain), SchedulerConfig(max_batch=4, token_budget=16))
        reqs = {
            0: ([1, 2, 3], SamplingParams(max_new_tokens=25, temperature=0.9, seed=1,
                                           ignore_eos=True)),
            1: ([4, 5], SamplingParams(max_new_tokens=20, temperature=0.7, top_k=5, top_p=0.9,
                                       seed=2, repetition_penalty=1.3, frequency_penalty=0.5,
                                       ignore_eos=True)),
            2: ([6, 7, 8, 9], SamplingParams(max_new_tokens=18, temperature=0, logprobs=3,
                                             ignore_eos=True)),
            3: ([10], SamplingParams(max_new_tokens=22, temperature=0, ignore_eos=True))}
        out = {i: [] for i in reqs}
        lps = {i: [] for i in reqs}
        for i, (p, sp) in reqs.items():
            runner.add(i, p, sp)
        steps = 0
        while runner.has_work():
            for ev in runner.step():
                out[ev.request_id] += ev.token_ids
                lps[ev.request_id] += [(lp.token_id, round(lp.logprob, 5), len(lp.top))
                                       for lp in ev.logprobs]
            steps += 1
            assert steps < 500
        return runner, out, lps

    chained, out_c, lp_c = run(True)
    plain, out_p, lp_p = run(False)
    assert chained.chained_steps > 10 and plain.chained_steps == 0
    assert out_c == out_p and lp_c == lp_p
    assert [len(out_c[i]) for i in range(4)] == [25, 20, 18, 22]
    assert len(lp_c[2]) == 18 and all(n == 3 for *_, n in lp_c[2])
    assert len(set(out_c[0])) > 3          # it sampled (a greedy row would repeat a cycle)
