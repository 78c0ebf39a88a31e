"""The L2 prefetch plan of the batch-1 decode (qwen_trt/fast/prefetch.py): parsing, the byte
ranges each kernel is given, and that it stays off where it cannot apply (CPU)."""
from __future__ import annotations

import pytest
import torch

from qwen_trt.fast import TINY, build_model
from qwen_trt.fast.prefetch import MB, Prefetch, PrefetchPlan, decode_prefetches, plan_for


def test_plan_parse():
    assert PrefetchPlan.parse("1") == PrefetchPlan()
    off = PrefetchPlan.parse("off")
    assert not off.any and not off.evict_first
    p = PrefetchPlan.parse("o=2, gu=24,down=4.5,next=0,evict=0,bulk=1")
    assert (p.o, p.gate_up_mb, p.down_mb, p.next_mb, p.evict_first, p.bulk) == (
        2, 24, 4.5, 0, False, True)
    for bad in ("gu", "x=1", "gu=abc", "down=-1", "o=3"):
        with pytest.raises(ValueError, match="QWEN_TRT_L2_PREFETCH"):
            PrefetchPlan.parse(bad)


def test_prefetch_head_ranges():
    t = torch.empty(1024, 1024, dtype=torch.bfloat16)            # 2 MB
    whole = Prefetch.head(t, float("inf"))
    assert (whole.nbytes, whole.parts) == (2 * MB, 1)
    halves = Prefetch.head(t, 0.25, parts=2)                       # gate/up: both halves
    assert (halves.nbytes, halves.parts, halves.stride) == (MB // 4, 2, MB)
    assert Prefetch.head(t, 3, parts=2).nbytes == MB                # capped at the part
    assert Prefetch.head(t, 0) is None
    assert Prefetch.head(t, 1e-6) is None                          # under 256 bytes: nothing
    assert halves.kernel_args() == {"PF_BYTES": MB // 4, "PF_PARTS": 2, "PF_STRIDE": MB,
                                    "PF_BULK": False}


def test_decode_prefetches_chain_to_the_next_layer_and_the_head():
    m = build_model(TINY, max_seq_len=64, dtype=torch.float32, device="cpu")
    pfs = decode_prefetches(PrefetchPlan(gate_up_mb=1, down_mb=1, next_mb=1), m.layers,
                            m._head())
    assert len(pfs) == TINY.layers
    for i, (layer, pf) in enumerate(zip(m.layers, pfs)):
        assert pf.qkv.t is layer.wo and pf.qkv.nbytes == layer.wo.numel() * 4
        assert pf.rope is None
        assert pf.o.t is layer.w_gate_up and pf.o.parts == 2
        assert pf.gate_up.t is layer.w_down
        nxt = m.layers[i + 1].wqkv if i + 1 < TINY.layers else m._head()
        assert pf.down.t is nxt
    assert all(p == type(p)() for p in decode_prefetches(None, m.layers, m._head()))
    rope = decode_prefetches(PrefetchPlan(o=2), m.layers, m._head())
    assert rope[0].qkv is None and rope[0].rope.t is m.layers[0].wo


def test_plan_is_off_on_cpu(monkeypatch):
    monkeypatch.setenv("QWEN_TRT_L2_PREFETCH", "1")
    assert plan_for(torch.device("cpu")) is None
