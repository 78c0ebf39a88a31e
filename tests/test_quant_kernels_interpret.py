"""The packed-weight kernels (FP8 blocks, INT4 groups: qwen_trt/fast/qkernels.py) on CPU in
Triton's interpreter (float32), against the same weights dequantized: the batch-1 GEMV with its
fusions, the small-batch GEMM, the dequantize kernel, and the tiny model's greedy tokens through
the Triton decode. ``make test-kernels`` runs them; without Triton they skip."""
from __future__ import annotations

from triton_interp import interpret, triton_interpreter  # noqa: F401 (autouse fixture)


def test_packed_gemv_gemm_and_dequantize_match_dequantized_weights():
    res = interpret("""
        import json, torch
        import torch.nn.functional as F
        from qwen_trt.fast import qkernels as K
        from qwen_trt.fast.gemv import gemv_ref
        from qwen_trt.fast.qformats import QuantSpec, quantize
        torch.manual_seed(0)
        # (rows, K, fusions): ragged rows, K one block / several blocks / not a block multiple
        cases = [(96, 256, dict(ln=True)), (50, 384, dict(residual=True)),
                 (130, 128, dict(ln=True, gate_up=True)), (37, 200, {})]
        errs, deq = [], []
        for fmt in ("fp8", "int4"):
            for rows, k, f in cases:
                if fmt == "int4" and k % 64:
                    continue
                w = quantize(torch.randn(rows, k) * 0.1, QuantSpec(fmt, group=64))
                wd = w.dequantize(torch.float32)
                deq.append((K.dequantize(w, torch.float32) - wd).abs().max().item())
                n = rows // 2 if f.get("gate_up") else rows
                kw = dict(eps=1e-6, gate_up=f.get("gate_up", False),
                          ln=1 + 0.1 * torch.randn(k) if f.get("ln") else None,
                          residual=torch.randn(n) if f.get("residual") else None)
                x = torch.randn(k)
                ref = gemv_ref(wd, x, **kw)
                # steps below, at and above a block / group; pipelined and unrolled loops
                # whole blocks per step (BK a multiple of the block / group), unrolled
                for bn, bk, unroll, blk in ((1, 64, False, False), (4, 128, False, False),
                                            (2, 512, True, False), (4, 64, True, False),
                                            (2, 256, True, True), (4, 128, False, True)):
                    got = K.qgemv(w, x, config=K.QConfig(block_n=bn, bk=bk, unroll=unroll,
                                                         blocked=blk), **kw)
                    errs.append(((got - ref).norm() / ref.norm()).item())
                for m in (2, 5):
                    xm = torch.randn(m, k)
                    res = torch.randn(m, n) if f.get("residual") else None
                    y = F.linear(xm, wd)
                    if kw["gate_up"]:
                        g, u = y.chunk(2, dim=-1)
                        y = F.silu(g) * u
                    if res is not None:
                        y = res + y
                    for bn, bk in ((16, 64), (32, 128)):
                        got = K.qbgemm(w, xm, residual=res, gate_up=kw["gate_up"],
                                       config=K.QConfig(block_n=bn, bk=bk))
                        errs.append(((got - y).norm() / y.norm()).item())
        print(json.dumps({"errs": errs, "deq": deq}))
    """)
    assert len(res["errs"]) == 7 * (6 + 4), len(res["errs"])
    assert max(res["errs"]) < 1e-5, res["errs"]
    assert max(res["deq"]) == 0.0


def test_tiny_greedy_tokens_through_packed_kernels_equal_dequantized_reference(tiny_model_dir):
    """The Triton decode (packed GEMVs, attention kernels) on an FP8 and an INT4 tiny model:
    the self-check passes, and the greedy tokens equal the PyTorch decode on the same weights
    dequantized."""
    res = interpret(f"""
        import json, torch
        from pathlib import Path
        from qwen_trt.fast import FastConfig, FastDecoder, build_model
        from qwen_trt.fast.decoder import check_decode_kernels
        from qwen_trt.fast.qformats import QuantSpec
        from qwen_trt.fast.weights import load_safetensors
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


def test_tuner_keeps_the_fastest_configuration_that_builds():
    res = interpret("""
        import json
        import triton.testing
        from qwen_trt.fast import qkernels as K
        calls = []
        class Fake:                      # a kernel: config "b" fails to build, "c" is fastest
            fn = K._qgemv_kernel.fn
            def __getitem__(self, grid):
                def launch(*args, name, num_warps, num_stages, **kw):
                    if name == "b":
                        raise RuntimeError("out of registers")
                    calls.append(name)
                return launch
        cost = {"a": 3.0, "c": 1.0, "d": 2.0}
        triton.testing.do_bench = lambda fn, **kw: (fn(), cost[calls[-1]])[1]
        t = K._Tuner(Fake(), [({"name": n}, 4, 3) for n in "abcd"])
        t("key", lambda meta: (1,), (), {})
        first = list(calls)
        calls.clear()
        t("key", lambda meta: (1,), (), {})
        print(json.dumps({"best": t.best["key"][0]["name"], "again": calls,
                          "tried": sorted(set(first)), "timed": sorted(t.timed["key"])}))
    """)
    assert res["best"] == "c" and res["again"] == ["c"]        # tuned once, then launched
    assert res["tried"] == ["a", "c", "d"] and len(res["timed"]) == 3
