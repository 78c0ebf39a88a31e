"""The packed-kernel sweep's bookkeeping (no GPU): which configurations its results put in the
kernel tables, and the items it times."""
from __future__ import annotations

import pytest
import torch

from qwen_trt.bench import qkernel_sweep as S
from qwen_trt.fast.kernels import qkernels as Q
from qwen_trt.fast.model.qformats import QuantSpec, quantize


def _best(us: float, cfg: dict | None) -> dict:
    return {"us": us, "TBps": 1.0, "cfg": cfg}


def test_tables_take_the_fastest_packed_configs_and_dense_only_where_split_k_won():
    gemv = {"block_n": 2, "warps": 4, "ctas_per_sm": 3, "ahead": 1}
    mm = {"block_n": 64, "warps": 4, "stages": 3, "prefetch": False, "split": 8}
    sweep = {"best": {
        "qkv|qgemv|fp8|M1": _best(8.1, gemv),
        "gate_up|qgemv|int4|M1": _best(20.0, dict(gemv, block_n=4, ahead=2)),
        "o|qbgemm|fp8|M8": _best(11.0, mm),
        "o|qbgemm|none|M8": _best(9.3, mm),          # beats bgemm: listed
        "o|bgemm|none|M8": _best(11.3, None),
        "qkv|qbgemm|none|M32": _best(13.1, dict(mm, split=4)),   # loses to bgemm: not listed
        "qkv|bgemm|none|M32": _best(11.2, None),
        "down|scaled_mm|fp8-rowwise|M8": None,       # over the error bound: no entry
    }}
    gemv_t, gemm_t = S.tables(sweep)
    assert gemv_t == {(Q.FMT_FP8, 6144, 2560, False): Q.QConfig(**gemv),
                      (Q.FMT_INT4, 9728, 2560, True): Q.QConfig(**dict(gemv, block_n=4,
                                                                         ahead=2))}
    assert gemm_t == {(Q.FMT_FP8, 2560, 4096, 16): Q.QConfig(**mm),
                      (Q.FMT_DENSE, 2560, 4096, 16): Q.QConfig(**mm)}


def test_committed_tables_cover_every_projection_and_defaults_fill_the_rest():
    for name, (n, k, gate_up, _r, _ln) in S.SHAPES["4b"].items():
        nout = n // 2 if gate_up else n
        for fmt in (Q.FMT_FP8, Q.FMT_INT4):
            assert (fmt, nout, k, gate_up) in Q.GEMV_TABLE, name
            assert Q.gemv_config(fmt, nout, k, gate_up) is Q.GEMV_TABLE[(fmt, nout, k, gate_up)]
            for bm in (16, 32):
                assert (fmt, nout, k, bm) in Q.GEMM_TABLE, (name, bm)
    small = Q.gemm_config(Q.FMT_FP8, 256, 512, 16)       # a tiny model: split while K allows
    assert small.split == 1 and small.block_n == 32
    assert Q.gemm_config(Q.FMT_FP8, 2560, 9728, 64).split > 1       # few strips: split-K
    assert Q.gemv_config(Q.FMT_FP8, 300, 640, False).block_n == 16


def test_sweep_items_time_every_kind_once_per_configuration():
    items = S.items("4b")
    keys = [S._key(it) for it in items]
    assert len(keys) == len(set(keys))
    kinds = {(it["kind"], it["fmt"], it["m"]) for it in items if it["shape"] == "o"}
    for m in S.GEMM_ROWS:
        for fmt in ("fp8", "int4", "none"):
            assert ("qbgemm", fmt, m) in kinds
        assert {("bgemm", "none", m), ("cublas", "none", m),
                ("scaled_mm", "fp8-rowwise", m)} <= kinds
    assert {("qgemv", "fp8", 1), ("qgemv", "int4", 1), ("gemv", "none", 1)} <= kinds


def test_printed_tables_reproduce_the_committed_ones():
    """``--print-tables`` on the committed sweeps gives back the tables in qkernels.py."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # the full sweep, then the FP8/INT4 GEMV sweep of the folded-scale kernel, then the FP8
    # one with the f16x2 form, then FP8 and INT4 with it (issue 26)
    sweep = S.merged(*(json.loads((root / "docs/measurements" / name).read_text())
                       for name in ("qkernel-sweep-h200.json",
                                    "qkernel-sweep-fold-h200.json",
                                    "qkernel-sweep-half-h200.json",
                                    "qkernel-sweep-int4-half-h200.json")))
    ns = {"QConfig": Q.QConfig, "FMT_FP8": Q.FMT_FP8, "FMT_INT4": Q.FMT_INT4,
          "FMT_DENSE": Q.FMT_DENSE}
    exec(S.table_source(sweep), ns)      # noqa: S102 - our own generated source
    assert ns["GEMV_TABLE"] == Q.GEMV_TABLE
    assert ns["GEMM_TABLE"] == Q.GEMM_TABLE


def test_tensor_core_gemv_is_a_sweep_candidate_not_a_default():
    """Issue 26: the pipelined tensor-core GEMV (``QConfig.dot``, qwen_trt.bench.qkernel_forms)
    is swept for every FP8 and INT4 projection and is not in the committed table (measured
    slower); ``qgemv`` does not run it, so a sweep it wins leaves that entry to the table
    (``--print-tables`` agrees) and the other winners go in."""
    assert not any(c.dot for c in Q.GEMV_TABLE.values())
    for name in S.SHAPES["4b"]:
        for fmt in ("fp8", "int4"):
            dots = [c for c in S.gemv_candidates(fmt, name) if c.get("dot")]
            assert len(dots) >= 5, (name, fmt)
            assert all(Q.QConfig(**c).dot for c in dots)
    keys = [S._key(it) for it in S.items("4b", "qgemv:fp8")]
    assert len(keys) == len(set(keys)) and any("dot=True" in k for k in keys)
    win = {"block_n": 64, "warps": 4, "bk": 128, "stages": 4, "split": 2, "dot": True,
           "l2pre": 2}
    sweep = {"best": {"qkv|qgemv|fp8|M1": _best(6.0, win),
                      "down|qgemv|int4|M1": _best(9.0, dict(win, l2pre=0, split=4))}}
    plain = {"block_n": 8, "warps": 8, "ctas_per_sm": 1, "ahead": 1, "half": True}
    sweep["best"]["o|qgemv|int4|M1"] = _best(5.0, plain)
    gemv_t, _ = S.tables(sweep)
    assert gemv_t == {(Q.FMT_INT4, 2560, 4096, False): Q.QConfig(**plain)}
    ns = {"QConfig": Q.QConfig, "FMT_FP8": Q.FMT_FP8, "FMT_INT4": Q.FMT_INT4,
          "FMT_DENSE": Q.FMT_DENSE}
    exec(S.table_source(sweep), ns)      # noqa: S102 - our own generated source
    assert ns["GEMV_TABLE"] == gemv_t
    w = quantize(torch.randn(64, 256), QuantSpec("fp8"))
    with pytest.raises(ValueError, match="qkernel_forms"):
        Q.qgemv(w, torch.randn(256), config=Q.QConfig(**win))


def test_vs_table_sweep_times_only_the_committed_config_besides_the_new_candidates():
    """``--vs-table``: per FP8 / INT4 projection exactly one non-``dot`` configuration, the
    committed one, so applying the sweep can only keep it or replace it by a faster one."""
    its = S.items("4b", "qgemv", vs_table=True)
    for name, (n, k, gate_up, _r, _ln) in S.SHAPES["4b"].items():
        nout = n // 2 if gate_up else n
        for fmt, f in (("fp8", Q.FMT_FP8), ("int4", Q.FMT_INT4)):
            mine = [it for it in its if it["shape"] == name and it["fmt"] == fmt]
            old = [Q.QConfig(**it["cfg"]) for it in mine if not it["cfg"].get("dot")]
            assert old == [Q.GEMV_TABLE[(f, nout, k, gate_up)]], (name, fmt)
            assert len(mine) - 1 == len(S.DOT_CANDIDATES[(fmt, name)])


def test_probe_items_pair_each_packed_gemv_with_its_probe_and_never_win():
    """``--probe``: per projection and format, the measured kernel and the same configuration
    with ``probe`` (nothing else differs), beside the bf16 GEMV."""
    its = S.items("4b", probe=True)
    for name in S.SHAPES["4b"]:
        assert sum(it["kind"] == "gemv" and it["shape"] == name for it in its) == 1
        for fmt in ("fp8", "int4"):
            mine = [it["cfg"] for it in its if it["shape"] == name and it["fmt"] == fmt]
            probes = [c for c in mine if c.get("probe")]
            assert len(probes) == 1, (name, fmt)
            plain = {a: b for a, b in probes[0].items() if a != "probe"}
            assert plain in mine, (name, fmt)
            if fmt == "fp8":
                assert plain.get("fold"), name        # the probe lives in the folded kernel
    for it in its:                                 # every configuration is a valid one
        if "cfg" in it:
            Q.QConfig(**it["cfg"])
    # a probe is never the best, however fast (its results are wrong by design)
    best: dict = {}
    plain = next(it for it in its if it["fmt"] == "fp8" and not it["cfg"].get("probe"))
    probe = dict(plain, cfg=dict(plain["cfg"], probe=True))
    S.keep_best(best, plain, {"us": 8.0, "TBps": 2.0, "rel_err": 0.002})
    S.keep_best(best, probe, {"us": 1.0, "TBps": 16.0, "rel_err": 0.001})
    S.keep_best(best, dict(plain, cfg={**plain["cfg"], "warps": 4}),
                {"us": 7.0, "TBps": 2.3, "rel_err": 0.5})          # over the error bound
    assert list(best.values()) == [{"us": 8.0, "TBps": 2.0, "cfg": plain["cfg"]}]
