"""``qwen-trt bench`` smoke test on CPU: JSON structure and token counts, no timing checks."""
from __future__ import annotations

import json

from qwen_trt.cli import main


def test_bench_quick_on_tiny_checkpoint(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", str(tiny_model_dir), "--device", "cpu", "--quick",
               "--prompt-lens", "8,20", "--new-tokens", "6", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["command"].startswith("qwen-trt bench --model")
    assert res["env"]["device"] == "cpu" and res["env"]["copy_TBps"] is None
    assert res["model"]["params"] > 0
    assert res["paths"]["hf-static"]["status"].startswith("skipped")
    assert res["paths"]["trtllm"]["status"].startswith("skipped")
    for p in ("hf-eager", "torch", "fast"):
        assert res["paths"][p]["status"] == "ok"
    assert res["paths"]["fast"]["hf_model_freed"] is True   # its memory figure is its own
    rows = {(r["path"], r["prompt_len"]): r for r in res["rows"]}
    assert set(rows) == {(p, n) for p in ("hf-eager", "torch", "fast") for n in (8, 20)}
    for r in rows.values():
        assert r["new_tokens"] == 6 and r["tokens_ok"] is True
        assert r["ttft_ms_p50"] > 0 and r["ttft_ms_p95"] >= r["ttft_ms_p50"]
        assert r["decode_tok_s"] > 0
        assert r["vs_hf_eager"] is not None
    assert rows[("hf-eager", 8)]["vs_hf_eager"] == 1.0
    # greedy on the same float32 weights: the fast path and our reference agree with HF generate
    for key in ("fast_vs_hf-eager", "torch_vs_hf-eager"):
        for n in ("8", "20"):
            assert res["parity"][key][n] == {"matching_prefix": 6, "of": 6}
    table = capsys.readouterr().out
    assert "| path | prompt |" in table and "| fast | 20 |" in table


def test_bench_random_tiny_shape_without_model(tmp_path):
    out = tmp_path / "b.json"
    assert main(["bench", "--random-weights", "--shape", "tiny", "--device", "cpu", "--quick",
                 "--paths", "fast", "--new-tokens", "5", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["model"]["name"] == "random:tiny"
    assert [r["path"] for r in res["rows"]] == ["fast", "fast"]
    assert all(r["tokens_ok"] and r["new_tokens"] == 5 for r in res["rows"])
    assert res["parity"] == {}


def test_bench_rejects_unknown_path(capsys):
    assert main(["bench", "--device", "cpu", "--paths", "vllm"]) == 2
    assert "unknown path" in capsys.readouterr().err
