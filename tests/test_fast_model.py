"""The fast path's model and engine on CPU (float32, eager): same numbers and tokens as HF."""
from __future__ import annotations

import functools
import json
import threading

import pytest
import torch

from qwen_trt.errors import ModelSourceError, PromptTooLongError
from qwen_trt.fast import FastConfig, FastDecoder, build_model
from qwen_trt.fast.step.sampling import SamplerState, pick, sampler_kind
from qwen_trt.fast.model.weights import load_safetensors
from qwen_trt.params import SamplingParams

PROMPT = [5, 17, 99, 3, 250, 41, 7, 7, 300, 12, 60]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def fast_cfg(tiny_model_dir):
    return FastConfig.from_hf(json.loads((tiny_model_dir / "config.json").read_text()))


def make_engine(tiny_model_dir, cfg, **kw) -> FastDecoder:
    model = build_model(cfg, max_seq_len=kw.pop("max_seq_len", 256), dtype=torch.float32,
                        device="cpu")
    load_safetensors(model, tiny_model_dir)
    return FastDecoder(model, **kw)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, fast_cfg):
    # small KV buckets so a short generation crosses several of them
    return make_engine(tiny_model_dir, fast_cfg, kv_buckets=(16, 32, 64, 256))


def hf_greedy(hf_model, prompt, n):
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_config_matches_checkpoint(fast_cfg, hf_model):
    assert fast_cfg.n_params == sum(p.numel() for p in hf_model.parameters())
    assert fast_cfg.head_dim * fast_cfg.heads != fast_cfg.hidden   # like Qwen3-4B
    assert fast_cfg.rope_theta == 5_000_000.0


def test_config_rejects_rope_scaling():
    cfg = {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ModelSourceError, match="yarn"):
        FastConfig.from_hf(cfg)


def test_prefill_and_decode_logits_match_hf(engine, hf_model):
    model = engine.model
    with torch.no_grad():
        ref = hf_model(torch.tensor([PROMPT])).logits[0]
        got = model.prefill(torch.tensor(PROMPT), torch.tensor([len(PROMPT) - 1]))[0]
        torch.testing.assert_close(got, ref[-1], rtol=1e-4, atol=1e-4)
        # padded prefill: rows after ``last`` are ignored by the causal mask
        padded = torch.tensor(PROMPT + [1, 2, 3, 4, 5])
        got_pad = model.prefill(padded, torch.tensor([len(PROMPT) - 1]))[0]
        torch.testing.assert_close(got_pad, ref[-1], rtol=1e-4, atol=1e-4)
        # decode the next token against the cache the (unpadded) prefill wrote
        model.prefill(torch.tensor(PROMPT[:-1]), torch.tensor([len(PROMPT) - 2]))
        pos = torch.tensor([len(PROMPT) - 1])
        step = model.decode(torch.tensor([PROMPT[-1]]), pos, torch.arange(32))[0]
        torch.testing.assert_close(step, ref[-1], rtol=1e-4, atol=1e-4)


def test_greedy_matches_hf_generate(engine, hf_model):
    n = 60   # crosses the 16/32/64 KV buckets
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    got = list(engine.generate(PROMPT, params))
    assert got == hf_greedy(hf_model, PROMPT, n)
    assert len(set(got)) > 1   # not a degenerate single-token loop


def test_cache_reuse_across_requests(engine, hf_model):
    """A stopped request leaves stale cache rows; the next request must not see them."""
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    gen = engine.generate(list(reversed(PROMPT)) * 3, params)
    next(gen)
    gen.close()
    assert list(engine.generate(PROMPT[:5], params)) == hf_greedy(hf_model, PROMPT[:5], 30)


def test_stop_ids_and_max_new_tokens(engine):
    free = list(engine.generate(PROMPT, SamplingParams(max_new_tokens=20, temperature=0,
                                                       ignore_eos=True)))
    assert len(free) == 20
    stop_at = next(i for i, t in enumerate(free) if t != free[0])
    params = SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=(free[stop_at],))
    assert list(engine.generate(PROMPT, params)) == free[:stop_at + 1]
    ignored = SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=(free[stop_at],),
                             ignore_eos=True)
    assert list(engine.generate(PROMPT, ignored)) == free
    assert list(engine.generate(PROMPT, SamplingParams(max_new_tokens=1, temperature=0))) == free[:1]


def test_cancel_stops_before_next_token(engine):
    cancel = threading.Event()
    out = []
    for tok in engine.generate(PROMPT, SamplingParams(max_new_tokens=50, temperature=0,
                                                      ignore_eos=True), cancel):
        out.append(tok)
        if len(out) == 3:
            cancel.set()
    assert len(out) == 3


def test_prompt_too_long(tiny_model_dir):
    from qwen_trt.backends.fast_backend import FastBackend

    backend = FastBackend.load(str(tiny_model_dir), device="cpu", max_seq_len=64, warmup=False)
    with pytest.raises(PromptTooLongError, match="exceeds this backend's limits"):
        backend.check_request([1] * 60, SamplingParams(max_new_tokens=10))


def test_sampling_is_seeded_and_filtered(engine):
    p = SamplingParams(max_new_tokens=25, temperature=0.9, top_p=0.9, top_k=20, seed=7,
                       ignore_eos=True)
    a = list(engine.generate(PROMPT, p))
    assert a == list(engine.generate(PROMPT, p))
    other = [list(engine.generate(PROMPT, SamplingParams(**{**p.__dict__, "seed": s})))
             for s in (8, 9, 10)]
    assert any(o != a for o in other)
    top1 = SamplingParams(max_new_tokens=25, temperature=0.9, top_k=1, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=25, temperature=0, ignore_eos=True)
    assert list(engine.generate(PROMPT, top1)) == list(engine.generate(PROMPT, greedy))


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.5), (40, 0.7), (100, 0.9)])
def test_pick_respects_top_k_and_top_p(top_k, top_p):
    torch.manual_seed(0)
    vocab = 300
    logits = torch.randn(1, vocab) * 3
    params = SamplingParams(max_new_tokens=200, temperature=0.8, top_k=top_k, top_p=top_p, seed=1)
    st = SamplerState(200, vocab, "cpu")
    st.set(params)
    kind = sampler_kind(params)
    probs = torch.softmax(logits[0] / 0.8, -1)
    order = torch.argsort(probs, descending=True)
    k = top_k or vocab
    kept = probs[order[:k]] / probs[order[:k]].sum()
    before = torch.cumsum(kept, 0) - kept
    allowed = set(order[:k][before < top_p].tolist())
    seen = set()
    for i in range(200):
        st.step.fill_(i)
        seen.add(int(pick(logits, kind, st)))
    assert seen <= allowed
    assert len(seen) > 1 or len(allowed) == 1


def test_fast_backend_through_load_backend(tiny_model_dir, tiny_backend):
    from qwen_trt.backends import BackendConfig, load_backend
    from qwen_trt.backends.fast_backend import FastBackend, use_fast

    assert use_fast("auto", "cpu") is False and use_fast("auto", "cuda:0") is True
    assert use_fast("off", "cuda") is False and use_fast("on", "cpu") is True
    backend = load_backend(BackendConfig(backend="torch", model=str(tiny_model_dir), device="cpu",
                                         max_seq_len=128, fast="on"))
    assert isinstance(backend, FastBackend)
    assert backend.info.name == "torch-fast" and backend.info.max_seq_len == 128
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    ids = backend.tokenizer.encode("Hello, how are you", add_special_tokens=False)
    assert list(backend.stream(ids, params)) == list(tiny_backend.stream(ids, params))
    gen = backend.stream(ids, params)
    next(gen)
    backend.cancel()
    assert len(list(gen)) <= 1


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, top_k=20, seed=7,
                   ignore_eos=True),
    SamplingParams(max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=0, seed=3, ignore_eos=True),
    SamplingParams(max_new_tokens=16, temperature=0, repetition_penalty=1.8, presence_penalty=1.5,
                   ignore_eos=True),
    SamplingParams(max_new_tokens=16, temperature=0.8, top_k=50, seed=5, presence_penalty=-1.0,
                   repetition_penalty=0.7, ignore_eos=True),
])
def test_same_seed_same_tokens_with_fast_on_and_off(tiny_model_dir, tiny_backend, params):
    """One sampler for both torch paths: the fast decoder and HF transformers agree on CPU."""
    from qwen_trt.backends.fast_backend import FastBackend

    fast = FastBackend.load(str(tiny_model_dir), device="cpu", max_seq_len=128, warmup=False)
    ids = fast.tokenizer.encode("Hello, how are you", add_special_tokens=False)
    assert list(fast.stream(ids, params)) == list(tiny_backend.stream(ids, params))


def test_config_reads_transformers_4_layout():
    cfg = FastConfig.from_hf({"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8,
                              "intermediate_size": 16, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "num_key_value_heads": 1,
                              "rope_theta": 1234.0, "rope_scaling": None})
    assert cfg.rope_theta == 1234.0 and cfg.head_dim == 4 and cfg.kv_heads == 1


def test_buckets():
    from qwen_trt.fast.step.decoder import bucket_for, pow2_buckets

    assert pow2_buckets(16, 100) == (16, 32, 64, 100)
    assert pow2_buckets(16, 64) == (16, 32, 64)
    assert bucket_for(17, (16, 32)) == 32 and bucket_for(16, (16, 32)) == 16
    with pytest.raises(ValueError):
        bucket_for(33, (16, 32))


def test_triton_decode_that_cannot_run_falls_back_with_a_note(tiny_model_dir, fast_cfg, engine,
                                                             capsys):
    """Asking for the Triton decode where it cannot run (no GPU here) keeps the PyTorch decode,
    says why in the stats, and still generates the same tokens."""
    from qwen_trt.fast.loader import report_fallbacks

    fb = make_engine(tiny_model_dir, fast_cfg, kernels="triton", kv_buckets=(16, 32, 64, 256))
    assert fb.stats.kernels == "torch" and fb.model.decode_impl == "torch"
    assert any(n.startswith("triton decode kernels") for n in fb.stats.notes), fb.stats.notes
    report_fallbacks(fb)
    assert "triton decode kernels" in capsys.readouterr().err
    p = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    assert list(fb.generate(PROMPT, p)) == list(engine.generate(PROMPT, p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_gqa_attention_equals_expanded_heads(fast_cfg, tiny_model_dir, dtype):
    """The default prefill layer (SDPA over the cache slots with grouped-query heads) gives the
    same logits and cache as the older form that copies K/V per query head."""
    from qwen_trt.fast.model.model import prefill_layer

    model = build_model(fast_cfg, max_seq_len=64, dtype=dtype, device="cpu")
    load_safetensors(model, tiny_model_dir)
    ids = torch.tensor([5, 17, 99, 3, 250, 41, 7, 7, 300, 12, 60, 2, 9, 401])
    last = torch.tensor([len(ids) - 1])
    got = model.prefill(ids, last, layer_fn=prefill_layer)
    cache = [t.clone() for t in model.cache.kv(1)]
    want = model.prefill(ids, last, layer_fn=functools.partial(prefill_layer, expand_kv=True))
    assert torch.allclose(got.float(), want.float(), rtol=0, atol=1e-5 if dtype == torch.float32
                          else 1e-2)
    assert all(torch.equal(a, b) for a, b in zip(cache, model.cache.kv(1)))


