"""`qwen-trt bench --http` on CPU (the tiny model): the in-process runner and `qwen-trt serve`
+ the HTTP load generator on one closed-loop workload, side by side (shape, not speed)."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_served_bench_runs_both_paths_on_the_same_workload(tiny_model_dir, tmp_path):
    from qwen_trt.bench.served import main

    out = tmp_path / "served.json"
    rc = main(["--model", str(tiny_model_dir), "--device", "cpu", "--fast", "on",
               "--concurrency", "1,3", "--max-batch", "2", "--requests", "3",
               "--input-words", "8", "--output-tokens", "5", "--warmup", "1",
               "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 3]
    for lv in res["levels"]:
        for side in ("in_process", "http"):
            r = lv[side]
            assert r["requests"] == max(3, 2 * lv["concurrency"]) and r["errors"] == 0, (side, r)
            # ITL may be 0 on a loaded machine: the tiny model's steps are sub-millisecond, and
            # a client that reads late gets a request's tokens in one SSE event
            assert r["output_tok_s"] > 0 and r["ttft_ms_p50"] > 0 and r["itl_ms_p50"] >= 0
            assert r["ttft_ms_p90"] >= r["ttft_ms_p50"]
        assert lv["http_over_engine_tok_s"] == pytest.approx(
            lv["http"]["output_tok_s"] / lv["in_process"]["output_tok_s"], rel=1e-2)
    assert res["in_process"]["runner"] == "BatchRunner"
    assert res["http"]["healthy_s"] > 0
    one = res["levels"][0]                        # one stream: the batch-1 decoder beside it
    b1 = one["in_process"]["batch1_decoder"]
    assert b1["requests"] == 3 and b1["errors"] == 0 and b1["ttft_ms_p50"] > 0
    assert one["http_ttft_over_batch1_ms"] == pytest.approx(
        one["http"]["ttft_ms_p50"] - b1["ttft_ms_p50"], abs=1e-2)
    assert "batch1_decoder" not in res["levels"][1]["in_process"]


def test_level_stats_from_closed_loop_rows():
    from qwen_trt.bench.served import _level_stats

    # two requests: TTFT 10 and 30 ms; 5 tokens over 40 ms (ITL 10 ms) and 3 over 40 (20 ms)
    rows = [(0.0, 0.010, 0.050, 5), (0.0, 0.030, 0.070, 3)]
    s = _level_stats(rows, wall=0.1, errors=1)
    assert s["output_tok_s"] == 80.0 and s["errors"] == 1 and s["requests"] == 2
    assert s["itl_ms_p50"] == pytest.approx(15.0) and s["ttft_ms_p50"] == pytest.approx(20.0)


def test_timeline_records_steps_for_a_burst_and_a_closed_loop(tiny_model_dir):
    """bench.timeline on CPU (the tiny model, the fast path's eager step): per-step records of
    both workloads, the profiler window's summary, every request finished."""
    from qwen_trt.bench.timeline import TimelineConfig, run

    cfg = TimelineConfig(str(tiny_model_dir), device="cpu", fast="on", max_batch=4,
                         concurrency=3, requests=6, input_words=8, output_tokens=5,
                         profile_steps=3)
    res = run(cfg, log=lambda m: None)
    assert res["runner"] == "BatchRunner"
    for part, n in (("burst", 3), ("closed_loop", 6)):
        r = res[part]
        assert r["requests"] == n and r["errors"] == 0, (part, r)
        kinds = {k.split()[0] for k in r["steps"]}
        assert kinds == {"prefill", "decode"}, r["steps"]
        assert sum(v["steps"] for v in r["steps"].values()) >= 5
    prof = res["closed_loop"]["profile"]
    assert prof["steps"] == 3 and prof["host_wall_ms"] > 0


def test_step_sizes_times_each_prefill_size_alone_and_beside_decode_rows(tiny_model_dir, tmp_path):
    from qwen_trt.bench.step_sizes import main

    out = tmp_path / "steps.json"
    assert main(["--model", str(tiny_model_dir), "--device", "cpu", "--sizes", "16,40",
                 "--decode-rows", "3", "--decode-ctx", "20", "--repeats", "2",
                 "--pieces", "default,triton", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["pieces"], r["prefill_tokens"], r["decode_rows"]) for r in rows] == [
        (p, n, d) for p in ("default", "triton") for n in (16, 40) for d in (0, 3)]
    assert [r["step_tokens"] for r in rows] == [16, 19, 40, 43] * 2
    assert all(r["eager_ms"] > 0 and r["bucket"] >= r["step_tokens"] for r in rows)
