"""The fast path's Triton decode kernels, run on CPU in Triton's interpreter (float32).

The kernels themselves are measured and checked in bf16 on a GPU (tests/test_fast_cuda.py); this
checks their indexing, masking, fusions and the persistent loop on every CI run (``make
test-kernels``; the interpreter harness is tests/triton_interp.py, and without Triton the tests
skip).
"""
from __future__ import annotations

from triton_interp import interpret, triton_interpreter  # noqa: F401 (autouse fixture)


def test_gemv_kernels_match_unfused_ops():
    errs = interpret("""
        import json, torch
        import qwen_trt.fast.kernels.gemv as G
        torch.manual_seed(0)
        cases = [(96, 64, dict(ln=True)), (64, 128, dict(residual=True)),
                 (256, 64, dict(ln=True, gate_up=True)), (515, 64, dict(ln=True)),
                 (50, 70, {}), (40, 300, dict(ln=True, residual=True))]
        out = []
        for rows, k, f in cases:
            w, x = torch.randn(rows, k) * 0.1, torch.randn(k)
            n = rows // 2 if f.get("gate_up") else rows
            kw = dict(eps=1e-6, gate_up=f.get("gate_up", False),
                      ln=1 + 0.1 * torch.randn(k) if f.get("ln") else None,
                      residual=torch.randn(n) if f.get("residual") else None)
            ref = G.gemv_ref(w, x, **kw)
            for cfg in (G.GemvConfig(1, 32, 4, 64), G.GemvConfig(4, 64, 4, 32), None):
                got = G.gemv(w, x, config=cfg, **kw)
                out.append(((got - ref).norm() / ref.norm()).item())
            for bn, grid in ((1, 3), (2, 5), (4, 7)):   # persistent: several blocks per program
                got = torch.empty(n)
                G._gemv_persistent_kernel[(grid,)](
                    w, x, got, kw["ln"] if kw["ln"] is not None else x,
                    kw["residual"] if kw["residual"] is not None else got, 1e-6, N=n, K=k,
                    KP=1 << (k - 1).bit_length(), BLOCK_N=bn, NORM=kw["ln"] is not None,
                    RESIDUAL=kw["residual"] is not None, GATE_UP=kw["gate_up"], PDL=False,
                    P=grid)
                out.append(((got - ref).norm() / ref.norm()).item())
        print(json.dumps(out))
    """)
    assert len(errs) == 6 * 6
    assert max(errs) < 1e-5, errs


def test_rope_cache_and_attention_kernels_match_unfused_ops(tmp_path):
    res = interpret("""
        import json, torch
        from qwen_trt.fast.kernels.attention import check_triton
        from qwen_trt.fast.model.config import TINY
        from qwen_trt.fast.model.reference import rope_tables
        from qwen_trt.fast.kernels.rope_cache import qk_rope_cache, qk_rope_cache_ref
        torch.manual_seed(0)
        cfg, slots = TINY, 300
        cos, sin = rope_tables(cfg, slots, "cpu")
        qn, kn = 1 + 0.1 * torch.randn(cfg.head_dim), 1 + 0.1 * torch.randn(cfg.head_dim)
        diffs = []
        for p in (0, 1, 64, 299):
            qkv = torch.randn(cfg.q_size + 2 * cfg.kv_size)
            pos = torch.tensor([p])
            c = [torch.zeros(cfg.kv_heads, slots, cfg.head_dim) for _ in range(4)]
            q1 = qk_rope_cache(qkv, qn, kn, cos, sin, pos, c[0], c[1], 1e-6, cfg.heads)
            q2 = qk_rope_cache_ref(qkv, qn, kn, cos, sin, pos, c[2], c[3], 1e-6, cfg.heads)
            diffs += [(q1 - q2).abs().max().item(), (c[0] - c[2]).abs().max().item(),
                      (c[1] - c[3]).abs().max().item(), float(c[0][:, p].abs().sum() > 0)]
        attn = check_triton(torch.device("cpu"), torch.float32, 2, 4, 32, 300, tol=1e-5)
        # the fused kernel (norms + RoPE + cache write inside the first attention kernel)
        # against the two steps, over a cache with history, in float32 and bfloat16
        from qwen_trt.fast.kernels.attention import decode_attention, rope_decode_attention
        from qwen_trt.fast.options import KernelOptions, configure
        fused = []
        for dt, pre, split in ((torch.float32, "1", None), (torch.bfloat16, "1", None),
                               (torch.float32, "0", None), (torch.float32, "1", 128)):
            configure(KernelOptions(attn_preload=pre == "1"))   # K/V tile loaded before the wait
            for p in (0, 5, 63, 64, 130):
                qkv = torch.randn(cfg.q_size + 2 * cfg.kv_size).to(dt)
                pos = torch.tensor([p])
                hist = torch.randn(2, cfg.kv_heads, slots, cfg.head_dim).to(dt)
                c = [hist[i % 2].clone() for i in range(4)]
                q = qk_rope_cache(qkv, qn.to(dt), kn.to(dt), cos.to(dt), sin.to(dt), pos, c[0],
                                  c[1], 1e-6, cfg.heads)
                o1 = decode_attention(q, c[0], c[1], pos).float()
                o2 = rope_decode_attention(qkv, qn.to(dt), kn.to(dt), cos.to(dt), sin.to(dt),
                                           pos, c[2], c[3], 1e-6, cfg.heads,
                                           split=split).float()
                fused.append([((o1 - o2).norm() / o1.norm()).item(),
                              (c[0].float() - c[2].float()).abs().max().item(),
                              (c[1].float() - c[3].float()).abs().max().item()])
        print(json.dumps({"diffs": diffs, "attention": attn, "fused": fused}))
    """)
    d = res["diffs"]
    assert max(d[i] for i in range(len(d)) if i % 4 != 3) < 1e-5, d
    assert all(d[i] == 1.0 for i in range(3, len(d), 4))   # the key landed at pos
    assert res["attention"] is None, res["attention"]
    f32, bf16 = res["fused"][:5] + res["fused"][10:], res["fused"][5:10]
    assert len(f32) == 15
    assert all(o < 1e-6 and k == 0 and v == 0 for o, k, v in f32), f32
    assert all(o < 1e-2 and k == 0 and v == 0 for o, k, v in bf16), bf16


def test_decode_with_the_kernels_equals_the_pytorch_decode(tiny_model_dir):
    """Step by step after a prefill, the Triton decode's logits equal the PyTorch decode's; the
    engine's self-check passes on the real kernels and catches a broken one (a negated query)
    even with a 4096-slot cache, where the spare slot alone would dilute the new key."""
    res = interpret(f"""
        import json, torch
        from pathlib import Path
        import qwen_trt.fast.model.model as M
        from qwen_trt.fast import FastConfig, FastDecoder, build_model
        from qwen_trt.fast.step.checks import check_decode_kernels
        from qwen_trt.fast.model.weights import load_safetensors
        from qwen_trt.params import SamplingParams
        d = Path({str(tiny_model_dir)!r})
        cfg = FastConfig.from_hf(json.loads((d / "config.json").read_text()))
        model = build_model(cfg, max_seq_len=4096, dtype=torch.float32, device="cpu")
        load_safetensors(model, d)
        checks = [check_decode_kernels(model)]
        good = M.rope_decode_attention     # q/k norms + RoPE live in the attention kernel
        M.rope_decode_attention = lambda qkv, qn, *a, **k: good(qkv, -qn, *a, **k)  # -query
        checks.append(check_decode_kernels(model))
        M.rope_decode_attention = good

        prompt = [5, 17, 99, 3, 250, 41, 7, 7, 300, 12] * 7
        with torch.inference_mode():
            model.prefill(torch.tensor(prompt), torch.tensor([len(prompt) - 1]))
            kv_pos = torch.arange(4097)
            errs, toks = [], [5, 301, 44, 17, 250, 9]   # distinct inputs, one per step
            for i, t in enumerate(toks):
                tok, pos = torch.tensor([t]), torch.tensor([len(prompt) + i])
                model.decode_impl, model.attn_impl = "triton", "triton"
                got = model.decode(tok, pos, kv_pos)
                model.decode_impl, model.attn_impl = "torch", "math"
                ref = model.decode(tok, pos, kv_pos)
                errs.append(((got - ref).norm() / ref.norm()).item())

        p = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
        small = build_model(cfg, max_seq_len=160, dtype=torch.float32, device="cpu")
        load_safetensors(small, d)
        ref_gen = list(FastDecoder(small, compile=False).generate(prompt, p))
        eng = FastDecoder(small, compile=False, attention="triton", kernels="triton")
        got_gen = list(eng.generate(prompt, p))
        print(json.dumps({{"checks": checks, "errs": errs,
                          "kernels": eng.stats.kernels, "notes": eng.stats.notes,
                          "ref": ref_gen, "got": got_gen}}))
    """)
    assert res["checks"][0] is None, res["checks"]
    assert res["checks"][1] and "differ" in res["checks"][1], res["checks"]
    assert len(res["errs"]) == 6 and max(res["errs"]) < 1e-5, res["errs"]
    assert res["kernels"] == "triton", res["notes"]
    assert len(res["ref"]) == 6 and res["got"] == res["ref"]


def test_step_pieces_as_triton_kernels_match_the_batched_steps_pytorch_pieces():
    """QWEN_TRT_STEP_TRITON=1: bgemm's row norm (with and without the residual add) and SiLU·up
    of any row count, and batched._pre_triton / _post_triton, against batched.py's PyTorch
    pieces; ragged widths (masked tails) and zero rows included."""
    errs = interpret("""
        import json, torch
        from qwen_trt.fast.kernels.bgemm import rms_rows, silu_mul_rows
        from qwen_trt.fast.step.batched import (_post_attention, _post_triton, _pre_attention,
                                           _pre_triton)
        from qwen_trt.fast.model.reference import rms_norm
        torch.manual_seed(0)
        out = {}
        for rows, k in ((1, 64), (5, 96), (3, 100), (0, 64)):
            x, r, w = torch.randn(rows, k), torch.randn(rows, k), 1 + 0.1 * torch.randn(k)
            got = rms_rows(x, w, 1e-6)
            out[f"norm{rows}x{k}"] = (got - rms_norm(x, w, 1e-6)).abs().max().item() if rows else 0.0
            h, n = rms_rows(x, w, 1e-6, residual=r)
            if rows:
                out[f"add{rows}x{k}"] = max((h - (x + r)).abs().max().item(),
                                            (n - rms_norm(x + r, w, 1e-6)).abs().max().item())
        for rows, i in ((2, 40), (3, 1500)):          # more than one program per row
            gu = torch.randn(rows, 2 * i)
            ref = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
            out[f"silu{rows}x{i}"] = (silu_mul_rows(gu) - ref).abs().max().item()
        t, d, q, inter = 6, 64, 96, 80
        x, o = torch.randn(t, d), torch.randn(t, q)
        ln, ln2 = 1 + 0.1 * torch.randn(d), 1 + 0.1 * torch.randn(d)
        wqkv, wo = torch.randn(3 * d, d) * 0.1, torch.randn(d, q) * 0.1
        wgu, wd = torch.randn(2 * inter, d) * 0.1, torch.randn(d, inter) * 0.1
        a, b = _pre_triton(x, ln, wqkv, 1e-6), _pre_attention(x, ln, wqkv, 1e-6)
        out["pre"] = ((a - b).norm() / b.norm()).item()
        a, b = (f(x, o, wo, ln2, wgu, wd, 1e-6) for f in (_post_triton, _post_attention))
        out["post"] = ((a - b).norm() / b.norm()).item()
        print(json.dumps(out))
    """)
    assert len(errs) == 11, errs
    assert all(v < 1e-5 for v in errs.values()), errs
