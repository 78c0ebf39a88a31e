"""Packed weights (FP8, INT4) on a GPU: the kernels at Qwen3-4B shapes against the dequantized
weights, and the tiny model's greedy tokens through the graph-captured Triton decode (batch 1
and the batched runner) equal to the same weights dequantized on the PyTorch path."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from qwen_trt.fast import FastConfig, FastDecoder, build_model
from qwen_trt.fast.kernels.gemv import gemv, gemv_ref
from qwen_trt.fast.model.qformats import QuantSpec, quantize
from qwen_trt.fast.kernels.linear import dense
from qwen_trt.fast.model.weights import load_safetensors
from qwen_trt.params import SamplingParams

pytestmark = pytest.mark.cuda

PROMPT = [5, 17, 99, 3, 250, 41, 7, 7, 300, 12, 60, 2, 9, 401]
SHAPES = [(6144, 2560, {"ln": True}), (19456, 2560, {"gate_up": True, "ln": True}),
          (2560, 9728, {"residual": True}), (300, 640, {"ln": True})]


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_packed_kernels_match_dequantized_weights(fmt, shape):
    from qwen_trt.fast.kernels.bgemm import bgemm
    from qwen_trt.bench.qkernel_forms import dq_gemv
    from qwen_trt.fast.kernels.qkernels import QConfig, dequantize, qgemv

    n, k, f = shape
    torch.manual_seed(0)
    w = quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16), QuantSpec(fmt))
    wd = w.dequantize(torch.bfloat16)
    assert torch.equal(dequantize(w, torch.bfloat16), wd)
    rows = n // 2 if f.get("gate_up") else n
    kw = dict(eps=1e-6, gate_up=f.get("gate_up", False),
              ln=(1 + 0.1 * torch.randn(k, device="cuda")).bfloat16() if f.get("ln") else None,
              residual=torch.randn(rows, device="cuda").bfloat16() if f.get("residual") else None)
    x = torch.randn(k, device="cuda").bfloat16()
    ref = gemv_ref(wd, x, **kw).float()
    got = gemv(w, x, **kw).float()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    # the inline-PTX forms (FP8 word loads and in-register converts; INT4 one lop3 a nibble)
    # and FP8 with the block scales folded into the activations, FP8 in f16x2 (``half``)
    # and the pipelined tensor-core GEMV (issue 26): wgmma (64 rows) and mma.sync (32),
    # split-K, several blocks a step, L2 prefetches before the PDL wait
    for cfg in (QConfig(block_n=2, warps=8, ctas_per_sm=2, asm=True),
                QConfig(block_n=1, warps=4, ctas_per_sm=4, ahead=2, asm=True),
                QConfig(block_n=2, warps=4, ctas_per_sm=4, fold=True),
                QConfig(block_n=4, warps=8, ctas_per_sm=2, ahead=2, fold=True),
                QConfig(block_n=8, warps=8, ctas_per_sm=2, half=True),
                QConfig(block_n=4, warps=8, ctas_per_sm=2, ahead=2, half=True),
                QConfig(block_n=8, warps=4, ctas_per_sm=2, half=True),
                QConfig(block_n=64, warps=4, bk=128, stages=4, split=1, dot=True),
                QConfig(block_n=64, warps=4, bk=256, stages=3, split=4, dot=True, l2pre=2),
                QConfig(block_n=32, warps=4, bk=256, stages=4, split=2, dot=True),
                QConfig(block_n=128, warps=8, bk=128, stages=4, split=8, dot=True)):
        got = (dq_gemv if cfg.dot else qgemv)(w, x, config=cfg, **kw).float()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2, cfg
    for m in (2, 8, 32):
        xm = torch.randn(m, k, device="cuda").bfloat16()
        res = torch.randn(m, rows, device="cuda").bfloat16() if f.get("residual") else None
        y = F.linear(xm, wd)
        if kw["gate_up"]:
            g, u = y.chunk(2, dim=-1)
            y = F.silu(g) * u
        if res is not None:
            y = res + y
        got = bgemm(w, xm, residual=res, gate_up=kw["gate_up"]).float()
        # same bf16 weights and rounding steps; only the accumulation order differs
        assert ((got - y.float()).norm() / y.float().norm()).item() < 1e-2, m


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_tensor_core_gemv_ragged_shapes_and_captured_graph(fmt):
    """The tensor-core GEMV where K is not whole 128-column blocks (FP8: the masked load),
    rows ragged against the block, and replayed from a CUDA graph (PDL edges)."""
    from qwen_trt.bench.qkernel_forms import dq_gemv
    from qwen_trt.fast.kernels.qkernels import QConfig

    torch.manual_seed(1)
    for n, k, f in ((300, 200, {"ln": True}), (70, 384, {"gate_up": True}),
                    (100, 640, {"residual": True})):
        if fmt == "int4" and k % 128:
            continue
        w = quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16),
                     QuantSpec(fmt))
        wd = w.dequantize(torch.bfloat16)
        rows = n // 2 if f.get("gate_up") else n
        kw = dict(eps=1e-6, gate_up=f.get("gate_up", False),
                  ln=(1 + 0.1 * torch.randn(k, device="cuda")).bfloat16() if f.get("ln")
                  else None,
                  residual=torch.randn(rows, device="cuda").bfloat16() if f.get("residual")
                  else None)
        x = torch.randn(k, device="cuda").bfloat16()
        ref = gemv_ref(wd, x, **kw).float()
        for cfg in (QConfig(block_n=64, warps=4, bk=128, stages=4, dot=True),
                    QConfig(block_n=16, warps=4, bk=256, stages=3, split=3, dot=True,
                            l2pre=1)):
            got = dq_gemv(w, x, config=cfg, **kw).float()
            assert ((got - ref).norm() / ref.norm()).item() < 1e-2, (n, k, cfg)
            g = torch.cuda.CUDAGraph()
            dq_gemv(w, x, config=cfg, **kw)
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                out = dq_gemv(w, x, config=cfg, **kw)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, dq_gemv(w, x, config=cfg, **kw)), (n, k, cfg)


def _tiny(tiny_model_dir, quant, dtype=torch.float32):
    cfg = FastConfig.from_hf(json.loads((tiny_model_dir / "config.json").read_text()))
    model = build_model(cfg, max_seq_len=512, dtype=dtype, device="cuda", quant=quant)
    load_safetensors(model, tiny_model_dir)
    return model


def _dequantized(model):
    """A dense copy of ``model`` holding its packed projections dequantized."""
    ref = build_model(model.cfg, max_seq_len=model.max_seq_len, dtype=model.dtype,
                      device="cuda")
    with torch.no_grad():
        src = dict(model.named_buffers())
        for name, b in ref.named_buffers():
            if name.startswith(("cache.", "cos", "sin")):
                continue
            parts = name.split(".")
            if parts[0] == "layers" and parts[2] in ("wqkv", "wo", "w_gate_up", "w_down"):
                b.copy_(dense(getattr(model.layers[int(parts[1])], parts[2]), model.dtype))
            else:
                b.copy_(src[name])
    return ref


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_tiny_greedy_tokens_packed_kernels_equal_dequantized_reference(tiny_model_dir, fmt):
    params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    model = _tiny(tiny_model_dir, QuantSpec(fmt, group=64))
    ref = FastDecoder(_dequantized(model), kernels="torch", compile=False, graphs=False)
    want = list(ref.generate(PROMPT, params))
    fast = FastDecoder(model)
    fast.warmup()
    assert fast.stats.kernels == "triton" and fast.stats.graphs, fast.stats.notes
    assert list(fast.generate(PROMPT, params)) == want


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_batched_decode_with_packed_weights_matches_math_step(tiny_model_dir, fmt):
    from qwen_trt.fast.step.batched import SeqChunk
    from qwen_trt.fast.step.build import make_batched

    model = _tiny(tiny_model_dir, QuantSpec(fmt, group=64))
    bm = make_batched(model, kv_tokens=4096, warmup=False)
    assert bm.graphs, bm.stats.notes
    bs = bm.block_size
    tables = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(4)]
    positions = [3, 10, 20, 33]
    for i, (p, t) in enumerate(zip(positions, tables)):   # prefixes by the math path
        toks = [(7 * i + j) % 400 + 1 for j in range(p)]
        bm._forward_math(toks, list(range(p)), [SeqChunk(0, p, p, tuple(t))], [p - 1])
    tokens = [11, 12, 13, 14]
    got = bm.decode(tokens, positions, tables).float().clone()
    assert bm.stats.bucket_impl[4] in ("bgemm", "torch")
    ref = bm._forward_math(tokens, positions,
                           [SeqChunk(i, 1, p + 1, tuple(t)) for i, (p, t) in
                            enumerate(zip(positions, tables))], list(range(4))).float()
    assert bs >= 16
    assert ((got - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.parametrize("rows", [5, 512])
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: f"{s[0]}x{s[1]}")
def test_fp8_tensor_core_prefill_matches_dequantized_weights(shape, rows):
    """The FP8 prefill on tensor cores (cuBLAS's block-scaled GEMM through torch._scaled_mm)
    at Qwen3-4B shapes: within the FP8 activations' rounding of the dequantized product; and
    its load-time self-check passes on this GPU (Hopper)."""
    from qwen_trt.fast.loader import check_fp8_prefill
    from qwen_trt.fast.model.qformats import Fp8Linear, fp8_quantize
    from qwen_trt.fast.kernels.linear import fp8_scaled_linear

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("cuBLAS's block-scaled FP8 GEMM is Hopper's")
    assert check_fp8_prefill(torch.device("cuda")) is None
    n, k, _ = shape
    g = torch.Generator(device="cuda").manual_seed(n)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    lin = Fp8Linear(*fp8_quantize(w), (128, 128)).cuda()
    x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
    ref = F.linear(x.float(), lin.dequantize(torch.float32))
    got = fp8_scaled_linear(x, lin).float()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 0.05, err


def test_fp8_act_quant_kernel_matches_the_torch_ops():
    """The activations' FP8 quantization in one Triton kernel (the batched steps' tensor-core
    prefill) against :func:`fp8_act_quant`'s PyTorch ops: the same scales, written
    outer-dimension-major, and the same FP8 values (a division rounded differently may move
    a value across a rounding boundary: at most one in a thousand); rows ragged against the
    kernel's block."""
    from qwen_trt.fast.model.qformats import fp8_act_quant
    from qwen_trt.fast.kernels.qkernels import act_quant

    torch.manual_seed(0)
    for m, k in ((1, 2560), (37, 4096), (512, 9728)):
        x = (torch.randn(m, k, device="cuda") * 3).to(torch.bfloat16)
        q, s = act_quant(x)
        q_ref, s_ref = fp8_act_quant(x)
        assert s.shape == s_ref.shape and s.stride() == (1, m), (s.shape, s.stride())
        assert torch.allclose(s, s_ref, rtol=1e-6, atol=0), (m, k)
        same = (q.float() == q_ref.float()).float().mean().item()
        assert same >= 0.999, (m, k, same)


def test_fp8_without_tensor_cores_forced_on_this_gpu_runs_w8a16_and_says_so(tiny_model_dir):
    """QWEN_TRT_FP8_TENSOR_CORES=0 on the H200 (no pre-Ada GPU is at hand): an FP8 checkpoint
    loads with the W8A16 note, gives the same greedy tokens as without the switch, and asking
    for the tensor-core prefill then is the one-line error."""
    from qwen_trt.errors import ModelSourceError
    from qwen_trt.fast import load_fast_decoder
    from qwen_trt.fast.options import KernelOptions, use

    cfg = FastConfig.from_hf(json.loads((tiny_model_dir / "config.json").read_text()))
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)

    def run(env):
        with use(KernelOptions.from_env(env)):
            dec = load_fast_decoder(cfg, weights=str(tiny_model_dir), max_seq_len=512,
                                    dtype=torch.bfloat16, device="cuda", quantization="fp8")
            return dec.stats.notes, list(dec.generate(PROMPT, params))

    notes, forced = run({"QWEN_TRT_FP8_TENSOR_CORES": "0"})
    assert any("without FP8 tensor cores: W8A16 kernels" in n for n in notes), notes
    plain_notes, plain = run({})
    assert forced == plain and not any("without FP8" in n for n in plain_notes)
    with pytest.raises(ModelSourceError, match="needs FP8 tensor cores"):
        run({"QWEN_TRT_FP8_TENSOR_CORES": "0", "QWEN_TRT_FP8_PREFILL": "tensorcore"})
