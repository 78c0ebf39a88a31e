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
    fast = tiny_engine(tiny_model_dir, torch.float32)
    assert fast.stats.compile and fast.stats.graphs and fast.stats.decode_graphs > 0
    assert fast.stats.attention == "triton", fast.stats.notes
    assert list(fast.generate(PROMPT, greedy(300))) == ref


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
    engine = FastEngine(model, compile=False, graphs=False)
    assert engine.stats.attention == "triton"
    assert list(engine.generate(prompt, greedy(32))) == ref
    model.attn_impl = "math"
    assert list(engine.generate(prompt, greedy(32))) == ref
