"""The packed-weight kernels (FP8 blocks, INT4 groups: qwen_trt/fast/kernels/qkernels.py) on CPU in
Triton's interpreter (float32), against the same weights dequantized: the batch-1 GEMV with its
fusions, the small-batch GEMM, the dequantize kernel, and the tiny model's greedy tokens through
the Triton decode. ``make test-kernels`` runs them; without Triton they skip."""
from __future__ import annotations

from triton_interp import interpret, triton_interpreter  # noqa: F401 (autouse fixture)


def test_packed_gemv_gemm_and_dequantize_match_dequantized_weights():
    res = interpret("""
        import json, torch
        import torch.nn.functional as F
        from qwen_trt.fast.kernels import qkernels as K
        from qwen_trt.fast.kernels.gemv import gemv_ref
        from qwen_trt.fast.model.qformats import QuantSpec, quantize
        torch.manual_seed(0)
        # (rows, K, group, fusions): ragged rows; K one block, several, not a block multiple,
        # a power of two of blocks and two pieces (640 = 4 + 1 blocks of 128); INT4 groups of
        # 64 (GEMM without tl.dot) and 128 (one tl.dot per nibble position)
        cases = [(96, 256, 64, dict(ln=True)), (50, 384, 128, dict(residual=True)),
                 (130, 128, 64, dict(ln=True, gate_up=True)), (37, 200, 64, {}),
                 (20, 640, 128, dict(ln=True)), (36, 256, 128, dict(gate_up=True))]
        errs, deq, n_gemv, n_gemm = [], [], 0, 0
        for fmt in ("fp8", "int4"):
            for rows, k, group, f in cases:
                if fmt == "int4" and k % group:
                    continue
                w = quantize(torch.randn(rows, k) * 0.1, QuantSpec(fmt, group=group))
                wd = w.dequantize(torch.float32)
                deq.append((K.dequantize(w, torch.float32) - wd).abs().max().item())
                n = rows // 2 if f.get("gate_up") else rows
                kw = dict(eps=1e-6, gate_up=f.get("gate_up", False),
                          ln=1 + 0.1 * torch.randn(k) if f.get("ln") else None,
                          residual=torch.randn(n) if f.get("residual") else None)
                x = torch.randn(k)
                ref = gemv_ref(wd, x, **kw)
                # one row block per program, several (the persistent loop), wide blocks; one
                # or two row blocks' loads in flight; FP8 also as int32 words (``asm``: the
                # inline-PTX convert on CUDA, shifts here)
                # FP8 also with the block scales folded into the activations (``fold``;
                # K % 16 == 0 there, else the plain kernel)
                for bn, programs, ahead, asm, fold in (
                        (1, 3, 1, False, False), (4, 2, 2, False, False),
                        (16, 1, 1, False, False), (2, 3, 2, False, False),
                        (2, 3, 1, True, False), (4, 2, 2, True, False),
                        (2, 3, 1, False, True), (4, 2, 2, False, True)):
                    got = K.qgemv(w, x, config=K.QConfig(block_n=bn, programs=programs,
                                                         ahead=ahead, asm=asm, fold=fold),
                                  **kw)
                    errs.append(((got - ref).norm() / ref.norm()).item())
                    n_gemv += 1
                for m in (2, 5):
                    xm = torch.randn(m, k)
                    res = torch.randn(m, n) if f.get("residual") else None
                    y = F.linear(xm, wd)
                    if kw["gate_up"]:
                        g, u = y.chunk(2, dim=-1)
                        y = F.silu(g) * u
                    if res is not None:
                        y = res + y
                    # one K share, split-K (partials + finish kernel), uneven splits; the
                    # plain loop and the hand-prefetched one
                    for bn, split, pre in ((16, 1, False), (32, 2, True), (16, 3, False)):
                        got = K.qbgemm(w, xm, residual=res, gate_up=kw["gate_up"],
                                       config=K.QConfig(block_n=bn, split=split, prefetch=pre))
                        errs.append(((got - y).norm() / y.norm()).item())
                        n_gemm += 1
        print(json.dumps({"errs": errs, "deq": deq, "gemv": n_gemv, "gemm": n_gemm}))
    """)
    assert res["gemv"] == 11 * 8 and res["gemm"] == 11 * 6, res
    assert max(res["errs"]) < 1e-5, res["errs"]
    assert max(res["deq"]) == 0.0


def test_half_gemvs_match_dequantized_weights_at_any_activation_scale():
    """The FP8 and INT4 GEMVs in f16x2 (``QConfig.half``: the products formed and summed in
    float16; INT4's zero point subtracted exactly): every fusion, K one block / group, several,
    two pieces (640 = 4 + 1 of 128), INT4 groups of 64 and 128, FP8 with K not a multiple of 16
    (the plain kernel then); activations from 1e-5 to 1e4 (the power of two that keeps the
    float16 sums in range) and all zero; within bf16 rounding (2 ** -8) of the dequantized
    weights."""
    res = interpret("""
        import json, torch
        from qwen_trt.fast.kernels import qkernels as K
        from qwen_trt.fast.kernels.gemv import gemv_ref
        from qwen_trt.fast.model.qformats import QuantSpec, quantize
        torch.manual_seed(0)
        cases = [(96, 256, 64, dict(ln=True)), (50, 384, 128, dict(residual=True)),
                 (130, 128, 64, dict(ln=True, gate_up=True)), (20, 640, 128, dict(ln=True)),
                 (36, 256, 128, dict(gate_up=True, residual=True)), (40, 200, 64, {})]
        errs, n = {"fp8": [], "int4": []}, 0
        for fmt in ("fp8", "int4"):
            for rows, k, group, f in cases:
                if fmt == "int4" and k % group:
                    continue
                w = quantize(torch.randn(rows, k) * 0.1, QuantSpec(fmt, group=group))
                wd = w.dequantize(torch.float32)
                nout = rows // 2 if f.get("gate_up") else rows
                kw = dict(eps=1e-6, gate_up=f.get("gate_up", False),
                          ln=1 + 0.1 * torch.randn(k) if f.get("ln") else None,
                          residual=torch.randn(nout) if f.get("residual") else None)
                for scale in (1.0, 1e4, 1e-5):
                    x = torch.randn(k) * scale
                    ref = gemv_ref(wd, x, **kw)
                    for bn, programs, ahead in ((1, 3, 1), (4, 2, 2)):
                        cfg = K.QConfig(block_n=bn, programs=programs, ahead=ahead, half=True)
                        got = K.qgemv(w, x, config=cfg, **kw)
                        errs[fmt].append(((got - ref).norm() / ref.norm()).item())
                        n += 1
        # all-zero activations (the largest magnitude 0: the scale saturates, nothing is NaN)
        zero = []
        for fmt in ("fp8", "int4"):
            w = quantize(torch.randn(64, 256) * 0.1, QuantSpec(fmt, group=128))
            r = torch.randn(64)
            got = K.qgemv(w, torch.zeros(256), residual=r, config=K.QConfig(half=True))
            zero.append(bool(torch.equal(got, r)))
        print(json.dumps({"errs": errs, "n": n, "zero": zero}))
    """)
    assert res["zero"] == [True, True], res["zero"]
    assert res["n"] == (6 + 5) * 3 * 2, res
    for fmt, errs in res["errs"].items():
        assert max(errs) < 3.9e-3, (fmt, errs)      # bf16 rounding: 2 ** -8


def test_tensor_core_gemv_matches_dequantized_weights():
    """The pipelined tensor-core GEMV (``QConfig.dot``, issue 26) for FP8 and INT4: every
    fusion it takes (RMSNorm prologue, residual, ``silu(gate) * up``), rows ragged against
    the block, K one block, several, not a block multiple (FP8: the masked load), steps of
    one and several blocks, split-K (partials + the finish kernel, uneven and more splits
    than steps), INT4 groups of 64 (no tl.dot) and 128; one program, a few, many."""
    res = interpret("""
        import json, torch
        from qwen_trt.bench.qkernel_forms import dq_gemv
        from qwen_trt.fast.kernels import qkernels as K
        from qwen_trt.fast.kernels.gemv import gemv_ref
        from qwen_trt.fast.model.qformats import QuantSpec, quantize
        torch.manual_seed(0)
        cases = [(96, 256, 64, dict(ln=True)), (50, 384, 128, dict(residual=True)),
                 (130, 128, 64, dict(ln=True, gate_up=True)), (37, 200, 64, {}),
                 (20, 640, 128, dict(ln=True, residual=True)),
                 (36, 256, 128, dict(gate_up=True, residual=True)),
                 (70, 384, 128, dict(ln=True, gate_up=True, residual=True))]
        errs, n = [], 0
        for fmt in ("fp8", "int4"):
            for rows, k, group, f in cases:
                if fmt == "int4" and k % group:
                    continue
                w = quantize(torch.randn(rows, k) * 0.1, QuantSpec(fmt, group=group))
                wd = w.dequantize(torch.float32)
                nout = rows // 2 if f.get("gate_up") else rows
                kw = dict(eps=1e-6, gate_up=f.get("gate_up", False),
                          ln=1 + 0.1 * torch.randn(k) if f.get("ln") else None,
                          residual=torch.randn(nout) if f.get("residual") else None)
                x = torch.randn(k)
                ref = gemv_ref(wd, x, **kw)
                for bn, bk, split, stages, pre in ((16, 128, 1, 2, 0), (32, 256, 2, 3, 2),
                                                   (16, 128, 3, 1, 0), (64, 128, 4, 4, 0),
                                                   (4, 512, 1, 3, 1)):
                    cfg = K.QConfig(block_n=bn, warps=4, bk=bk, split=split, stages=stages,
                                    dot=True, l2pre=pre)
                    got = dq_gemv(w, x, config=cfg, **kw)
                    errs.append(((got - ref).norm() / ref.norm()).item())
                    n += 1
        print(json.dumps({"errs": errs, "n": n}))
    """)
    assert res["n"] == 13 * 5, res
    assert max(res["errs"]) < 1e-5, res["errs"]


def test_split_k_gemm_of_dense_weights_matches_linear():
    """The split-K GEMM on dense weights (the bf16 projections' small-batch path where the
    sweep chose it): every fusion, K ragged against the step."""
    res = interpret("""
        import json, torch
        import torch.nn.functional as F
        from qwen_trt.fast.kernels import qkernels as K
        torch.manual_seed(0)
        errs = []
        for rows, k, f in ((96, 256, {}), (50, 200, {"residual": True}),
                           (130, 384, {"gate_up": True})):
            w = torch.randn(rows, k)
            n = rows // 2 if f.get("gate_up") else rows
            xm = torch.randn(3, k)
            res = torch.randn(3, n) if f.get("residual") else None
            y = F.linear(xm, w)
            if f.get("gate_up"):
                g, u = y.chunk(2, dim=-1)
                y = F.silu(g) * u
            if res is not None:
                y = res + y
            for bn, split, pre, bk in ((16, 1, False, 64), (32, 2, True, 128), (16, 4, False, 64)):
                got = K.qbgemm(w, xm, residual=res, gate_up=f.get("gate_up", False),
                               config=K.QConfig(block_n=bn, split=split, prefetch=pre, bk=bk))
                errs.append(((got - y).norm() / y.norm()).item())
        print(json.dumps({"errs": errs}))
    """)
    assert len(res["errs"]) == 9 and max(res["errs"]) < 1e-5, res["errs"]


def test_tiny_greedy_tokens_through_packed_kernels_equal_dequantized_reference(tiny_model_dir):
    """The Triton decode (packed GEMVs, attention kernels) on an FP8 and an INT4 tiny model:
    the self-check passes, and the greedy tokens equal the PyTorch decode on the same weights
    dequantized."""
    res = interpret(f"""
        import json, torch
        from pathlib import Path
        from qwen_trt.fast import FastConfig, FastDecoder, build_model
        from qwen_trt.fast.step.checks import check_decode_kernels
        from qwen_trt.fast.model.qformats import QuantSpec
        from qwen_trt.fast.model.weights import load_safetensors
        from qwen_trt.params import SamplingParams
        d = Path({str(tiny_model_dir)!r})
        cfg = FastConfig.from_hf(json.loads((d / "config.json").read_text()))
        p = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
        prompt = [5, 17, 99, 3, 250, 41, 7, 7, 300, 12]
        out = {{}}
        for fmt in ("fp8", "int4"):
            model = build_model(cfg, max_seq_len=160, dtype=torch.float32, device="cpu",
                                quant=QuantSpec(fmt, group=64))
            load_safetensors(model, d)
            check = check_decode_kernels(model)
            ref = list(FastDecoder(model, compile=False).generate(prompt, p))
            eng = FastDecoder(model, compile=False, attention="triton", kernels="triton")
            out[fmt] = dict(check=check, kernels=eng.stats.kernels, notes=eng.stats.notes,
                            ref=ref, got=list(eng.generate(prompt, p)),
                            packed=type(model.layers[0].w_down).__name__)
        print(json.dumps(out))
    """)
    for fmt, packed in (("fp8", "Fp8Linear"), ("int4", "Int4Linear")):
        r = res[fmt]
        assert r["packed"] == packed
        assert r["check"] is None and r["kernels"] == "triton", r
        assert len(r["ref"]) == 6 and r["got"] == r["ref"], r
