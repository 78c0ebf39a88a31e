"""Fast path on a GPU: greedy parity with HF, and CUDA-graph replay == the same code without."""
from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch

from qwen_trt.fast import QWEN3_4B, FastConfig, FastDecoder, build_model
from qwen_trt.fast.model.weights import load_safetensors, load_state_dict
from qwen_trt.params import SamplingParams

pytestmark = pytest.mark.cuda

PROMPT = [5, 17, 99, 3, 250, 41, 7, 7, 300, 12, 60, 2, 9, 401]


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def hf_greedy(hf_model, prompt, n):
    ids = torch.tensor([prompt], device=hf_model.device)
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def tiny_engine(tiny_model_dir, dtype, **kw) -> FastDecoder:
    cfg = FastConfig.from_hf(json.loads((tiny_model_dir / "config.json").read_text()))
    model = build_model(cfg, max_seq_len=512, dtype=dtype, device="cuda")
    load_safetensors(model, tiny_model_dir)
    engine = FastDecoder(model, **kw)
    engine.warmup()
    return engine


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_decode_attention_matches_math(dtype):
    from qwen_trt.fast.kernels.attention import check_triton, triton_usable

    assert triton_usable(torch.device("cuda"))
    # Qwen3-4B head layout; slots span many splits and a ragged tail
    assert check_triton(torch.device("cuda"), dtype, 8, 32, 128, 4097,
                        tol=1e-2 if dtype == torch.bfloat16 else 1e-5) is None


def test_tiny_greedy_parity_eager_and_graphs(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ref = hf_greedy(hf.to("cuda").eval(), PROMPT, 300)
    eager = tiny_engine(tiny_model_dir, torch.float32, compile=False, graphs=False)
    assert list(eager.generate(PROMPT, greedy(300))) == ref
    assert eager.stats.kernels == "triton", eager.stats.notes
    fast = tiny_engine(tiny_model_dir, torch.float32)
    assert fast.stats.compile and fast.stats.graphs and fast.stats.decode_graphs > 0
    assert fast.stats.attention == "triton", fast.stats.notes
    assert fast.stats.kernels == "triton", fast.stats.notes
    assert list(fast.generate(PROMPT, greedy(300))) == ref
    compiled = tiny_engine(tiny_model_dir, torch.float32, kernels="torch")
    assert compiled.stats.kernels == "torch"
    assert list(compiled.generate(PROMPT, greedy(300))) == ref


# Qwen3-4B projections (rows, k) and their fusions, plus ragged shapes that need masks.
GEMV_CASES = [
    ((6144, 2560), dict(ln=True)),                   # qkv
    ((2560, 4096), dict(residual=True)),             # o
    ((2 * 9728, 2560), dict(ln=True, gate_up=True)),  # gate/up
    ((2560, 9728), dict(residual=True)),             # down
    ((151936, 2560), dict(ln=True)),                 # LM head
    ((515, 64), dict(ln=True)),                      # tiny LM head: ragged rows
    ((50, 70), {}),                                  # ragged columns
]


@pytest.mark.parametrize("kernel", ["grid", "persistent", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,fuse", GEMV_CASES)
def test_triton_gemv_matches_unfused_ops(shape, fuse, dtype, kernel):
    from qwen_trt.fast.kernels.gemv import GemvConfig, gemv, gemv_ref

    g = torch.Generator(device="cuda").manual_seed(1)
    rows, k = shape
    n = rows // 2 if fuse.get("gate_up") else rows
    w = (torch.randn(rows, k, generator=g, device="cuda") * 0.05).to(dtype)
    x = torch.randn(k, generator=g, device="cuda").to(dtype)
    kw = dict(eps=1e-6, gate_up=fuse.get("gate_up", False),
              ln=(1 + 0.1 * torch.randn(k, generator=g, device="cuda")).to(dtype)
              if fuse.get("ln") else None,
              residual=torch.randn(n, generator=g, device="cuda").to(dtype)
              if fuse.get("residual") else None)
    config = {"grid": GemvConfig(block_n=4, warps=4, pre_k=2048),
              "persistent": GemvConfig(block_n=2, warps=8, ctas_per_sm=2),
              "auto": None}[kernel]
    got, ref = gemv(w, x, config=config, **kw), gemv_ref(w, x, **kw)
    assert got.shape == ref.shape == (n,) and got.dtype == dtype
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    if dtype == torch.float32:
        assert err < 1e-5, err
    else:
        # same rounding steps as the unfused ops: only the accumulation order differs, so
        # most outputs are bit-identical and the rest one bf16 step away
        assert err < 4e-3, err
        assert (got == ref).float().mean().item() > 0.8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_cache_kernel_matches_unfused_ops(dtype):
    from qwen_trt.fast.model.reference import rope_tables
    from qwen_trt.fast.kernels.rope_cache import qk_rope_cache, qk_rope_cache_ref

    g = torch.Generator(device="cuda").manual_seed(2)
    cfg = QWEN3_4B
    cos, sin = (t.to(dtype) for t in rope_tables(cfg, 600, "cuda"))
    qkv = torch.randn(cfg.q_size + 2 * cfg.kv_size, generator=g, device="cuda").to(dtype)
    qn, kn = ((1 + 0.1 * torch.randn(cfg.head_dim, generator=g, device="cuda")).to(dtype)
              for _ in range(2))
    for p in (0, 1, 517):
        pos = torch.tensor([p], device="cuda")
        caches = [torch.zeros(cfg.kv_heads, 600, cfg.head_dim, dtype=dtype, device="cuda")
                  for _ in range(4)]
        q1 = qk_rope_cache(qkv, qn, kn, cos, sin, pos, caches[0], caches[1], 1e-6, cfg.heads)
        q2 = qk_rope_cache_ref(qkv, qn, kn, cos, sin, pos, caches[2], caches[3], 1e-6,
                               cfg.heads)
        tol = (dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32
               else dict(atol=1e-2, rtol=1e-2))
        torch.testing.assert_close(q1, q2, **tol)
        torch.testing.assert_close(caches[0], caches[2], **tol)   # K written at p only
        torch.testing.assert_close(caches[1], caches[3], atol=0, rtol=0)   # V copied exactly
        assert caches[0][:, p].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rope_attention_matches_the_two_kernels(dtype):
    """rope_decode_attention (norms + RoPE + cache write inside the first attention kernel)
    against qk_rope_cache + decode_attention, Qwen3-4B heads, over a cache with history."""
    from qwen_trt.fast.kernels.attention import decode_attention, rope_decode_attention
    from qwen_trt.fast.model.reference import rope_tables
    from qwen_trt.fast.kernels.rope_cache import qk_rope_cache

    g = torch.Generator(device="cuda").manual_seed(3)
    cfg, slots = QWEN3_4B, 4097
    cos, sin = (t.to(dtype) for t in rope_tables(cfg, slots, "cuda"))
    qn, kn = ((1 + 0.1 * torch.randn(cfg.head_dim, generator=g, device="cuda")).to(dtype)
              for _ in range(2))
    hist = [torch.randn(cfg.kv_heads, slots, cfg.head_dim, generator=g, device="cuda").to(dtype)
            for _ in range(2)]
    for split in (None, 32, 128):
        for p in (0, 63, 64, 511, 2048, 4096):
            qkv = torch.randn(cfg.q_size + 2 * cfg.kv_size, generator=g, device="cuda").to(dtype)
            pos = torch.tensor([p], device="cuda")
            c = [hist[i % 2].clone() for i in range(4)]
            q = qk_rope_cache(qkv, qn, kn, cos, sin, pos, c[0], c[1], 1e-6, cfg.heads)
            ref = decode_attention(q, c[0], c[1], pos).float()
            got = rope_decode_attention(qkv, qn, kn, cos, sin, pos, c[2], c[3], 1e-6,
                                        cfg.heads, split=split).float()
            # V is copied; K may differ by a rounding step in bf16 (the norm's sum of squares
            # is reduced in another order by the fused kernel's layout)
            assert torch.equal(c[1], c[3]), (split, p)
            tol = (dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32
                   else dict(atol=1e-2, rtol=1e-2))
            torch.testing.assert_close(c[2], c[0], **tol)
            assert not torch.equal(c[2][:, p], hist[0][:, p])        # the new key landed
            err = ((got - ref).norm() / ref.norm()).item()
            assert err < (1e-5 if dtype == torch.float32 else 1e-2), (split, p, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_gqa_attention_matches_expanded_heads(dtype):
    """The prefill layer's grouped-query SDPA over the cache slots (cuDNN/flash in bf16) gives
    the layer output of SDPA over K/V expanded to every query head, at Qwen3-4B head shapes;
    a wrong head grouping would be far off."""
    from qwen_trt.fast.model.model import prefill_layer
    from qwen_trt.fast.model.weights import init_random

    cfg = dataclasses.replace(QWEN3_4B, layers=1)
    model = build_model(cfg, max_seq_len=1024, dtype=dtype, device="cuda")
    init_random(model, seed=0)
    layer = model.layers[0]
    weights = (layer.ln_in, layer.wqkv, layer.q_norm, layer.k_norm, layer.wo, layer.ln_post,
               layer.w_gate_up, layer.w_down)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in (7, 300, 1000):
        x = torch.randn(t, cfg.hidden, device="cuda", generator=gen).to(dtype)
        pos = torch.arange(t, device="cuda")
        outs, caches = [], []
        for fn in (prefill_layer, functools.partial(prefill_layer, expand_kv=True)):
            k_cache, v_cache = (c.zero_() for c in model.cache.kv(0))
            with torch.inference_mode():
                outs.append(fn(cfg, x, pos, model.cos, model.sin, weights, k_cache,
                               v_cache).float())
            caches.append((k_cache.clone(), v_cache.clone()))
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
        delta = outs[0] - outs[1]
        rel = (delta.norm() / (outs[1] - x.float()).norm()).item()   # of the layer's update
        assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-5), (t, rel)


def test_prefill_graph_captured_mid_request(tiny_model_dir):
    """No warm-up: each prefill bucket's graph is captured by the first prompt that needs it,
    and that prompt's first token must still come from its own last row."""
    cfg = FastConfig.from_hf(json.loads((tiny_model_dir / "config.json").read_text()))
    model = build_model(cfg, max_seq_len=512, dtype=torch.float32, device="cuda")
    load_safetensors(model, tiny_model_dir)
    lazy = FastDecoder(model)
    plain = FastDecoder(model, compile=False, graphs=False)
    for prompt in (PROMPT, PROMPT[:5], PROMPT * 3, PROMPT * 20):
        want = list(plain.generate(prompt, greedy(8)))
        assert list(lazy.generate(prompt, greedy(8))) == want, len(prompt)
    assert lazy.stats.prefill_graphs >= 3


def test_graph_replay_equals_compiled_without_graphs(tiny_model_dir):
    graphs = tiny_engine(tiny_model_dir, torch.bfloat16)
    plain = tiny_engine(tiny_model_dir, torch.bfloat16, graphs=False)
    for prompt in (PROMPT, PROMPT * 20):
        assert list(graphs.generate(prompt, greedy(200))) == list(plain.generate(prompt, greedy(200)))
    p = SamplingParams(max_new_tokens=100, temperature=0.8, top_p=0.9, top_k=20, seed=3,
                       ignore_eos=True)
    assert list(graphs.generate(PROMPT, p)) == list(plain.generate(PROMPT, p))
    full = SamplingParams(max_new_tokens=50, temperature=0.8, top_p=0.9, top_k=0, seed=3,
                          ignore_eos=True)   # captured lazily, mid-request
    assert list(graphs.generate(PROMPT, full)) == list(plain.generate(PROMPT, full))


@pytest.mark.slow
def test_full_size_float32_greedy_parity():
    """Qwen3-4B shapes, random weights, float32 on the GPU: HF generate vs our eager model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    hf_cfg = Qwen3Config(**{k: v for k, v in QWEN3_4B.to_hf().items()
                            if k not in ("model_type", "architectures")})
    with torch.device("cuda"):
        hf = Qwen3ForCausalLM(hf_cfg).eval()
    prompt = torch.randint(0, 150000, (512,)).tolist()
    ref = hf_greedy(hf, prompt, 32)
    with torch.no_grad():
        ref_logits = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
    model = build_model(QWEN3_4B, max_seq_len=1024, dtype=torch.float32, device="cuda")
    load_state_dict(model, hf.state_dict())
    del hf
    torch.cuda.empty_cache()
    with torch.no_grad():
        got_logits = model.prefill(torch.tensor(prompt, device="cuda"),
                                   torch.tensor([511], device="cuda"))[0].float()
    rel = ((got_logits - ref_logits).norm() / ref_logits.norm()).item()
    assert rel < 1e-3, rel
    engine = FastDecoder(model, compile=False, graphs=False)
    assert engine.stats.attention == "triton"
    assert list(engine.generate(prompt, greedy(32))) == ref
    assert engine.stats.kernels == "triton", engine.stats.notes
    model.decode_impl, model.attn_impl = "torch", "triton"
    assert list(engine.generate(prompt, greedy(32))) == ref
    model.attn_impl = "math"
    assert list(engine.generate(prompt, greedy(32))) == ref
