"""The paged-KV Triton kernels of the batched decode step, in Triton's CPU interpreter (float32),
against the PyTorch references. Skips without Triton (``make test-kernels`` installs a copy;
see tests/triton_interp.py); the GPU run is tests/test_batched_cuda.py."""
from __future__ import annotations

from triton_interp import interpret, triton_interpreter  # noqa: F401 (autouse fixture)


def test_paged_kernels_match_the_references():
    out = interpret("""
        import json, torch
        torch.manual_seed(0)
        from qwen_trt.fast.paged_kernels import (paged_rope_cache, paged_decode_attention,
            paged_attention_ref, table_slots)
        from qwen_trt.fast.rope_cache import qk_rope_cache_ref
        from qwen_trt.fast.model import rope_tables
        from qwen_trt.fast.config import TINY
        heads, kvh, d, bs, nblk = 4, 2, 32, 16, 24
        cos, sin = rope_tables(TINY, 512, "cpu")
        res = {}
        # rope + cache write, 3 rows at scattered slots
        qkv = torch.randn(3, (heads + 2 * kvh) * d)
        qn, kn = torch.randn(d), torch.randn(d)
        pos = torch.tensor([0, 37, 200]); slots = torch.tensor([5, 170, 300])
        kc = torch.full((kvh, nblk * bs, d), float("nan")); vc = kc.clone()
        q = paged_rope_cache(qkv, qn, kn, cos, sin, pos, slots, kc, vc, 1e-6, heads)
        err = 0.0
        for r in range(3):
            kr = torch.zeros(kvh, 512, d); vr = torch.zeros(kvh, 512, d)
            qr = qk_rope_cache_ref(qkv[r], qn, kn, cos, sin, pos[r:r+1], kr, vr, 1e-6, heads)
            err = max(err, (q[r] - qr).abs().max().item(),
                      (kc[:, slots[r]] - kr[:, pos[r]]).abs().max().item(),
                      (vc[:, slots[r]] - vr[:, pos[r]]).abs().max().item())
        res["rope"] = err
        # attention: 4 rows, ragged lengths over shuffled blocks (lengths cross splits)
        kc = torch.randn(kvh, nblk * bs, d); vc = torch.randn(kvh, nblk * bs, d)
        perm = (torch.randperm(nblk - 1) + 1).tolist()
        lens = [1, 16, 70, 129]
        tables = torch.zeros(4, 10, dtype=torch.int32)
        at = 0
        for i, n in enumerate(lens):
            k = -(-n // bs)
            tables[i, :k] = torch.tensor(perm[at:at + k]); at += k
        q = torch.randn(4, heads, d)
        got = paged_decode_attention(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), bs)
        err = 0.0
        for i, n in enumerate(lens):
            s = table_slots(tables[i], n, bs)
            ref = paged_attention_ref(q[i:i+1], kc, vc, s, torch.tensor([n - 1]))[0]
            err = max(err, ((got[i] - ref).norm() / ref.norm()).item())
        res["attn"] = err
        print(json.dumps(res))
    """)
    assert out["rope"] < 1e-5
    assert out["attn"] < 1e-5


def test_small_batch_projections_match_the_unfused_ops():
    out = interpret("""
        import json, torch
        import torch.nn.functional as F
        torch.manual_seed(0)
        from qwen_trt.fast.bgemm import bgemm, rms_rows, BgemmConfig
        from qwen_trt.fast.model import rms_norm
        res = {}
        for m in (2, 5, 17):
            x = torch.randn(m, 96)
            g = torch.randn(96)
            w = torch.randn(70, 96) / 10                 # ragged N and K vs the blocks
            wgu = torch.randn(2 * 40, 96) / 10
            r = torch.randn(m, 70)
            cfg = BgemmConfig(block_n=16, block_k=32, warps=4, stages=2)
            xn = rms_rows(x, g, 1e-6)
            e1 = (xn - rms_norm(x, g, 1e-6)).abs().max().item()
            e2 = (bgemm(w, xn, config=cfg) - F.linear(xn, w)).abs().max().item()
            e3 = (bgemm(w, xn, residual=r, config=cfg) - (r + F.linear(xn, w))).abs().max().item()
            gt, up = F.linear(xn, wgu).chunk(2, dim=-1)
            e4 = (bgemm(wgu, xn, gate_up=True, config=cfg) - F.silu(gt) * up).abs().max().item()
            res[m] = max(e1, e2, e3, e4)
        print(json.dumps(res))
    """)
    assert all(v < 1e-4 for v in out.values()), out
