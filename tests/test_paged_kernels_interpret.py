"""The paged-KV Triton kernels of the batched decode step, in Triton's CPU interpreter (float32),
against the PyTorch references. Skips without Triton (``make test-kernels`` installs a copy;
see tests/triton_interp.py); the GPU run is tests/test_batched_cuda.py."""
from __future__ import annotations

from triton_interp import interpret, triton_interpreter  # noqa: F401 (autouse fixture)


def test_paged_kernels_match_the_references():
    out = interpret("""
        import json, torch
        torch.manual_seed(0)
        from qwen_trt.fast.kernels.paged_kernels import (paged_rope_cache, paged_decode_attention,
            paged_attention_ref, table_slots)
        from qwen_trt.fast.kernels.rope_cache import qk_rope_cache_ref
        from qwen_trt.fast.model.model import rope_tables
        from qwen_trt.fast.model.config import TINY
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
        # fused: norms + RoPE + K/V write inside the first attention kernel, the new token
        # at the end of each row (pos = len - 1), with and without the K/V preload
        from qwen_trt.fast.options import KernelOptions, configure
        from qwen_trt.fast.kernels.paged_kernels import paged_rope_decode_attention
        pos = torch.tensor(lens) - 1
        slots = torch.tensor([int(tables[i, p // bs]) * bs + p % bs
                              for i, p in enumerate(pos.tolist())])
        qkv = torch.randn(4, (heads + 2 * kvh) * d)
        fused = []
        for pre in ("1", "0"):
            configure(KernelOptions(attn_preload=pre == "1"))
            for split in (None, 16, 64):
                c = [kc.clone(), vc.clone(), kc.clone(), vc.clone()]
                q = paged_rope_cache(qkv, qn, kn, cos, sin, pos, slots, c[0], c[1], 1e-6,
                                     heads)
                ref = paged_decode_attention(q, c[0], c[1], tables,
                                             torch.tensor(lens, dtype=torch.int32), bs)
                got = paged_rope_decode_attention(qkv, qn, kn, cos, sin, pos, slots, c[2], c[3],
                                                  tables, torch.tensor(lens, dtype=torch.int32),
                                                  bs, 1e-6, heads, split=split)
                fused.append(max(((got - ref).norm() / ref.norm()).item(),
                                 (c[0] - c[2]).abs().max().item(),
                                 (c[1] - c[3]).abs().max().item()))
        res["fused"] = fused
        print(json.dumps(res))
    """)
    assert out["rope"] < 1e-5
    assert out["attn"] < 1e-5
    assert len(out["fused"]) == 6 and max(out["fused"]) < 1e-5, out["fused"]


def test_small_batch_projections_match_the_unfused_ops():
    out = interpret("""
        import json, torch
        import torch.nn.functional as F
        torch.manual_seed(0)
        from qwen_trt.fast.kernels.bgemm import bgemm, rms_rows, BgemmConfig
        from qwen_trt.fast.model.model import rms_norm
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


def test_varlen_attention_matches_the_reference_for_a_mixed_step():
    """Decode rows, a fresh prompt, a chunk after a cached prefix and a chunk that crosses
    several blocks, in one launch over shuffled blocks, with padding tiles: each sequence as the
    math reference of that sequence alone; rows no tile covers stay zero."""
    out = interpret("""
        import json, torch
        torch.manual_seed(0)
        from qwen_trt.fast.kernels.paged_kernels import (paged_varlen_attention, paged_attention_ref,
            table_slots, varlen_tiles, varlen_max_tiles)
        heads, kvh, d, bs, nblk = 4, 2, 32, 16, 40
        kc = torch.randn(kvh, nblk * bs, d); vc = torch.randn(kvh, nblk * bs, d)
        perm = (torch.randperm(nblk - 1) + 1).tolist()
        # (query rows, context after the step)
        seqs = [(1, 1), (1, 45), (1, 130), (37, 37), (20, 70), (3, 16), (33, 120)]
        tables = torch.zeros(len(seqs), 12, dtype=torch.int32)
        at = 0
        for i, (n, ctx) in enumerate(seqs):
            k = -(-ctx // bs)
            tables[i, :k] = torch.tensor(perm[at:at + k]); at += k
        qlens = [n for n, _ in seqs]
        starts = [sum(qlens[:i]) for i in range(len(seqs))]
        total = sum(qlens)
        q = torch.randn(total + 5, heads, d)             # 5 padded rows at the end
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)
        res = {}
        for block_q in (16, 32):
            ts, tq = varlen_tiles(qlens, block_q)
            cap = varlen_max_tiles(total + 5, len(seqs) + 2, block_q)
            assert len(ts) <= cap
            n_tiles = len(ts)
            ts += [-1] * (cap - len(ts)); tq += [0] * (cap - len(tq))
            got = paged_varlen_attention(q, kc, vc, tables, i32([c for _, c in seqs]),
                                         i32(starts), i32(qlens), i32(ts), i32(tq), bs, block_q)
            err = 0.0
            for i, (n, ctx) in enumerate(seqs):
                ref = paged_attention_ref(q[starts[i]:starts[i] + n], kc, vc,
                                          table_slots(tables[i], ctx, bs),
                                          torch.arange(ctx - n, ctx))
                err = max(err, ((got[starts[i]:starts[i] + n] - ref).norm() / ref.norm()).item())
            res[block_q] = {"err": err, "pad": got[total:].abs().max().item(), "tiles": n_tiles}
        print(json.dumps(res))
    """)
    for r in out.values():
        assert r["err"] < 1e-5, out
        assert r["pad"] == 0.0
    assert out["16"]["tiles"] == 1 + 1 + 1 + 3 + 2 + 1 + 3
    assert out["32"]["tiles"] == 1 + 1 + 1 + 2 + 1 + 1 + 2


def test_batched_steps_with_the_varlen_kernel_match_the_math_steps():
    """The CUDA form of a step that prefills (fused RoPE + K/V write, varlen attention, the
    staged metadata of the step graphs) against the math form, on the tiny model: fresh
    prompts, then decode rows beside a continued chunk and a new prompt."""
    out = interpret("""
        import json, torch
        from qwen_trt.fast import TINY, build_model
        from qwen_trt.fast.step.batched import BatchedModel, SeqChunk
        from qwen_trt.fast.model.weights import init_random
        torch.manual_seed(0)
        m = build_model(TINY, max_seq_len=256, dtype=torch.float32, device="cpu")
        init_random(m, seed=1, std=0.5)
        w = {k: v.clone() for k, v in m.state_dict().items()}
        models = []
        for triton_on in (False, True):
            mm = build_model(TINY, max_seq_len=256, dtype=torch.float32, device="cpu")
            mm.load_state_dict(w, strict=False)
            bm = BatchedModel(mm, num_blocks=32, block_size=16)
            bm.triton = bm.varlen = triton_on
            models.append(bm)
        g = torch.Generator().manual_seed(3)
        ta, tb, tc = (3, 9, 4, 0, 0, 0), (7, 2, 11, 5, 1, 0), (6, 0, 0, 0, 0, 0)
        A = torch.randint(1, TINY.vocab_size, (30,), generator=g).tolist()
        B = torch.randint(1, TINY.vocab_size, (80,), generator=g).tolist()
        C = torch.randint(1, TINY.vocab_size, (5,), generator=g).tolist()
        steps = [
            (A[:20] + B[:40], list(range(20)) + list(range(40)),
             [SeqChunk(0, 20, 20, ta), SeqChunk(20, 40, 40, tb)], [19, 59]),
            ([A[20]] + B[40:75] + C, [20] + list(range(40, 75)) + list(range(5)),
             [SeqChunk(0, 1, 21, ta), SeqChunk(1, 35, 75, tb), SeqChunk(36, 5, 5, tc)],
             [0, 35, 40]),
        ]
        errs = []
        for args in steps:
            ref, got = (bm.forward(*args) for bm in models)
            errs.append(((got - ref).norm() / ref.norm()).item())
        print(json.dumps({"errs": errs}))
    """)
    assert max(out["errs"]) < 1e-5, out


def test_rope_cache_write_of_many_rows_matches_the_reference():
    """Prefill-sized steps take several rows per program (a ragged last program here)."""
    out = interpret("""
        import json, torch
        torch.manual_seed(0)
        from qwen_trt.fast.kernels.paged_kernels import paged_rope_cache
        from qwen_trt.fast.kernels.rope_cache import qk_rope_cache_ref
        from qwen_trt.fast.model.model import rope_tables
        from qwen_trt.fast.model.config import TINY
        heads, kvh, d, n = 4, 2, 32, 70
        cos, sin = rope_tables(TINY, 512, "cpu")
        qkv = torch.randn(n, (heads + 2 * kvh) * d)
        qn, kn = torch.randn(d), torch.randn(d)
        pos = torch.randperm(300)[:n]
        slots = torch.randperm(400)[:n]
        kc = torch.full((kvh, 400, d), float("nan")); vc = kc.clone()
        q = paged_rope_cache(qkv, qn, kn, cos, sin, pos, slots, kc, vc, 1e-6, heads)
        err = 0.0
        for r in range(n):
            kr = torch.zeros(kvh, 512, d); vr = torch.zeros(kvh, 512, d)
            qr = qk_rope_cache_ref(qkv[r], qn, kn, cos, sin, pos[r:r+1], kr, vr, 1e-6, heads)
            err = max(err, (q[r] - qr).abs().max().item(),
                      (kc[:, slots[r]] - kr[:, pos[r]]).abs().max().item(),
                      (vc[:, slots[r]] - vr[:, pos[r]]).abs().max().item())
        print(json.dumps({"err": err}))
    """)
    assert out["err"] < 1e-5, out
