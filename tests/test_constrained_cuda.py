"""Constrained decoding and logprobs on a GPU: the batch-1 decoder's ``+mask`` / ``+logprobs``
CUDA graphs read the sampler's mask buffer (no recapture per step), and the batched runner mixes
constrained, logprob and plain greedy rows (the plain ones chain again once alone). Tiny
checkpoint (real tokenizer layout), float32. Run on the H200:
``pytest -m cuda tests/test_constrained_cuda.py``."""
from __future__ import annotations

import pytest

from qwen_trt.serving.scheduler import batch_runner_for
import torch

from test_constrained import GRAMMARS, MAX_NEW, check_reply, prompt

from qwen_trt.serving.generation import ReplyStream
from qwen_trt.params import SamplingParams

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def gpu_fast(tiny_model_dir):
    from qwen_trt.backends.fast_backend import FastBackend

    backend = FastBackend.load(str(tiny_model_dir), device="cuda", dtype="float32")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def gpu_hf(tiny_model_dir):
    from qwen_trt.backends.torch_backend import TorchBackend

    backend = TorchBackend.load(str(tiny_model_dir), device="cuda", dtype="float32",
                                warmup=False)
    yield backend
    backend.close()


def run(backend, ids, params):
    with ReplyStream(backend, ids, params) as rs:
        deltas = list(rs.deltas())
    return rs.reply, [lp for d in deltas for lp in d.logprobs]


@pytest.mark.parametrize("kind", ["json_schema", "tool_calls_parallel", "json_object"])
def test_decoder_mask_graphs_match_the_hf_backend(gpu_fast, gpu_hf, tiny_tokenizer, kind):
    dec = gpu_fast.decoder
    assert dec.graphs, dec.stats.notes
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, logprobs=4,
                            grammar=GRAMMARS[kind])
    ids = prompt(tiny_tokenizer)
    fast, fast_lps = run(gpu_fast, ids, params)
    ref, ref_lps = run(gpu_hf, ids, params)
    assert fast.metrics.finish_reason == "stop"
    check_reply(kind, fast.text)
    assert fast.token_ids == ref.token_ids
    assert any(k.endswith("+mask+logprobs") for _, k in dec._decode_graphs), dec._decode_graphs
    for a, b in zip(fast_lps, ref_lps):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_decoder_unconstrained_requests_keep_their_graphs_and_tokens(gpu_fast, tiny_tokenizer):
    """A constrained request in between changes nothing for plain ones (mask reset per
    request; the plain graphs never read it)."""
    ids = prompt(tiny_tokenizer, "Hello, how are you today?")
    plain = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    before = list(gpu_fast.stream(ids, plain))
    list(gpu_fast.stream(ids, SamplingParams(max_new_tokens=MAX_NEW, temperature=0,
                                             grammar=GRAMMARS["json_object"])))
    assert list(gpu_fast.stream(ids, plain)) == before


def test_runner_mixes_constrained_logprob_and_chained_greedy_rows(tiny_model_dir,
                                                                  tiny_tokenizer, gpu_fast):
    from qwen_trt.backends.fast_backend import FastBackend
    from qwen_trt.serving.scheduler import SchedulerConfig

    backend = FastBackend.load(str(tiny_model_dir), device="cuda", dtype="float32",
                               for_runner=True)
    runner = batch_runner_for(backend, SchedulerConfig(max_batch=8, token_budget=256))
    reqs = {}
    for i in range(8):
        kind = ("json_schema", "tool_calls", None, None)[i % 4]
        lp = i in (2, 5)                      # row 2: plain with logprobs
        reqs[i] = (prompt(tiny_tokenizer, f"Request {i}: reply in JSON."), SamplingParams(
            max_new_tokens=MAX_NEW if kind else 60 if lp else 200, temperature=0,
            logprobs=2 if lp else None, ignore_eos=kind is None,
            grammar=GRAMMARS[kind] if kind else None), kind)
    out = {i: [] for i in reqs}
    lps = {i: [] for i in reqs}
    for i, (ids, params, _) in reqs.items():
        runner.add(i, ids, params)
    while runner.has_work():
        for ev in runner.step():
            out[ev.request_id] += ev.token_ids
            lps[ev.request_id] += ev.logprobs
    assert runner.chained_steps > 0          # constrained and logprob rows chain too
    for i, (ids, params, kind) in reqs.items():
        alone = list(gpu_fast.stream(ids, params))
        assert out[i] == [int(t) for t in alone], (i, kind)
        if kind:
            check_reply(kind, tiny_tokenizer.decode(out[i][:-1]))
        if params.logprobs is not None:
            assert [lp.token_id for lp in lps[i]] == out[i]
            for a, b in zip(lps[i], alone):
                assert a.logprob == pytest.approx(b.logprob.logprob, abs=1e-3)
    backend.close()
    torch.cuda.empty_cache()

