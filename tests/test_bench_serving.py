"""CPU smoke test of ``qwen-trt bench --concurrency``: tiny shapes, seconds; checks the figures
are there and consistent (timings themselves are not asserted)."""
from __future__ import annotations

import json

import torch

from qwen_trt.bench.serving import ServingBenchConfig, run_serving_bench


def test_serving_bench_smoke(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = ServingBenchConfig(random_weights=True, shape="tiny", device="cpu",
                                 dtype="float32", concurrency=(1, 3), prompt_len=12,
                                 new_tokens=6, long_prompt=40, turns=3, turn_tokens=40,
                                 token_budget=24, block_size=16, max_seq_len=256)
        res = run_serving_bench(cfg, log=lambda m: None)
    finally:
        torch.set_num_threads(n)
    json.dumps(res)                                           # JSON-serialisable
    for mode in ("burst", "poisson", "fifo"):
        for c in ("1", "3"):
            r = res[mode][c]
            assert r["tokens_ok"] and r["tokens"] == r["streams"] * 6
            assert r["aggregate_decode_tok_s"] > 0 and r["ttft_ms_p95"] >= r["ttft_ms_p50"]
            assert r["max_step_tokens"] <= 24
    assert res["burst"]["3"]["streams"] == 3 and res["poisson"]["3"]["streams"] == 6
    assert res["fifo"]["3"]["kv_peak_blocks"] <= res["burst"]["3"]["kv_peak_blocks"]
    assert res["long_prompt"]["3"]["long_ttft_ms"] > 0
    mt = res["multi_turn"]
    assert len(mt["reuse"]["ttft_ms"]) == 3
    assert mt["no_reuse"]["cached_tokens"] == [0, 0, 0]
    # turn 2's prompt starts with turn 1's prompt + reply (20 + 20 tokens): 2 full blocks
    assert mt["reuse"]["cached_tokens"][1] == 32 and mt["reuse"]["cached_tokens"][2] >= 64
    assert res["batch1_decoder"]["decode_tok_s_p50"] > 0 and "batch1_ratio" in res


def test_serving_bench_cli_quick(tmp_path, monkeypatch, capsys):
    from qwen_trt.cli import main

    monkeypatch.chdir(tmp_path)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = main(["bench", "--random-weights", "--shape", "tiny", "--device", "cpu", "--quick",
                   "--concurrency", "2", "--no-fifo", "--turns", "2", "--out",
                   str(tmp_path / "s.json")])
    finally:
        torch.set_num_threads(n)
    assert rc == 0
    res = json.loads((tmp_path / "s.json").read_text())
    assert "--concurrency 2" in res["command"] and res["config"]["token_budget"] == 32
    assert res["fifo"] == {} and res["burst"]["2"]["tokens_ok"]
    assert "| burst | 2 |" in capsys.readouterr().out
    assert main(["bench", "--device", "cpu", "--concurrency", "0"]) == 2   # one clear line
