"""``qwen-trt bench --plot``: the chart is drawn from a bench JSON (docs/measurements/bench-batch1-vs-hf-h200-first-kernels.json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen_trt.errors import QwenTrtError

ROOT = Path(__file__).resolve().parents[1]


def test_plot_from_the_saved_h200_run(tmp_path):
    pytest.importorskip("matplotlib")
    from qwen_trt.bench.plot import _series, plot_result

    result = json.loads((ROOT / "docs" / "measurements" / "bench-batch1-vs-hf-h200-first-kernels.json").read_text())
    series = _series(result, "decode_tok_s")
    assert set(series) >= {"hf-eager", "fast"}
    assert series["fast"][0] == [128, 512, 2048]
    out = plot_result(result, tmp_path / "chart.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_without_rows_is_one_clear_error(tmp_path):
    pytest.importorskip("matplotlib")
    from qwen_trt.bench.plot import plot_result

    with pytest.raises(QwenTrtError, match="no rows"):
        plot_result({"rows": []}, tmp_path / "x.png")
