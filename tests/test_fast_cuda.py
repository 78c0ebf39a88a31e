"""Fast path on a GPU: greedy parity with HF, and CUDA-graph replay == the same code without."""
from __future__ import annotations

import json

import pytest
import torch

from qwen_trt.fast import QWEN3_4B, FastConfig, FastEngine, build_model
from qwen_trt.fast.weights import load_safetensors, load_state_dict
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


def tiny_engine(tiny_model_dir, dtype, **kw) -> FastEngine:
    cfg = FastConfig.from_hf(json.loads((tiny_model_dir / "config.json").read_text()))
    model = build_model(cfg, max_seq_len=512, dtype=dtype, device="cuda")
    load_safetensors(model, tiny_model_dir)
    engine = FastEngine(model, **kw)
    engine.warmup()
    return engine


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_decode_attention_matches_math(dtype):
    from qwen_trt.fast.attention import check_triton, triton_usable

    assert triton_usable(torch.device("cuda"))
    # Qwen3-4B head layout; slots span many 128-slot splits and a ragged tail
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,fuse", GEMV_CASES)
def test_triton_gemv_matches_unfused_ops(shape, fuse, dtype):
    from qwen_trt.fast.gemv import gemv, gemv_ref

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
    got, ref = gemv(w, x, **kw), gemv_ref(w, x, **kw)
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
def test_fused_attention_matches_unfused_ops(dtype):
    """q/k norm + RoPE + cache write + split attention + in-kernel merge, at positions in the
    first chunk, on chunk edges and deep in the cache, against the PyTorch ops."""
    from qwen_trt.fast.attention_fused import AttendScratch, attend_qkv, attend_qkv_reference
    from qwen_trt.fast.model import rope_tables

    g = torch.Generator(device="cuda").manual_seed(2)
    cfg, slots = QWEN3_4B, 2100
    cos, sin = (t.to(dtype) for t in rope_tables(cfg, slots, "cuda"))
    qn, kn = ((1 + 0.1 * torch.randn(cfg.head_dim, generator=g, device="cuda")).to(dtype)
              for _ in range(2))
    k0 = torch.randn(cfg.kv_heads, slots, cfg.head_dim, generator=g, device="cuda").to(dtype)
    v0 = torch.randn(cfg.kv_heads, slots, cfg.head_dim, generator=g, device="cuda").to(dtype)
    scratch = AttendScratch(cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.head_dim, slots,
                            torch.device("cuda"))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for p in (0, 1, 63, 64, 65, 517, 2047, slots - 1):
        qkv = torch.randn(cfg.q_size + 2 * cfg.kv_size, generator=g, device="cuda").to(dtype)
        pos = torch.tensor([p], device="cuda")
        kc, vc, kr, vr = k0.clone(), v0.clone(), k0.clone(), v0.clone()
        got = attend_qkv(qkv, qn, kn, cos, sin, pos, kc, vc, 1e-6, cfg.heads, scratch)
        ref = attend_qkv_reference(qkv, qn, kn, cos, sin, pos, kr, vr, 1e-6, cfg.heads)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), (p, err)
        torch.testing.assert_close(kc, kr, **tol)            # the new key, only at p
        assert torch.equal(vc, vr)                           # the value, copied exactly
        assert not torch.equal(kc[:, p], k0[:, p])
        assert scratch.count.eq(0).all()                     # tickets reset for the next call
