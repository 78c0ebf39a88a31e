"""`make engine` / `qwen-trt build` on a machine without TensorRT-LLM: one line, non-zero exit."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from qwen_trt.cli import main

no_real_trtllm = pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None,
                                    reason="a real tensorrt_llm is installed here")
INSTALL_BITS = ('pip install -e ".[trtllm]"', "tensorrt_llm>=1.2,<1.3", "libopenmpi-dev",
                "NVIDIA's package index")


@no_real_trtllm
def test_build_without_tensorrt_llm_via_main(tiny_model_dir, capsys):
    rc = main(["build", "--gpu", "a10", "--model", str(tiny_model_dir)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("qwen-trt: error: TensorRT-LLM is not installed")
    for bit in INSTALL_BITS:
        assert bit in err
    assert err.count("\n") == 1 and "Traceback" not in err


@no_real_trtllm
def test_build_without_tensorrt_llm_subprocess(tiny_model_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-m", "qwen_trt", "build", "--gpu", "a10", "--model", str(tiny_model_dir),
         "--out-dir", str(tmp_path / "out"), "--engines-dir", str(tmp_path / "engines")],
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "TensorRT-LLM is not installed" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "engines").exists()


def test_bad_profile_name_is_reported_before_anything_else(capsys):
    rc = main(["build", "--gpu", "b20"])
    err = capsys.readouterr().err
    assert rc == 2 and "No build profile 'b20'" in err and "a10" in err


def test_list_profiles(capsys):
    assert main(["build", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("a10", "a10g", "l4", "a100", "h100", "h200", "rtx4090"):
        assert f"\n{name} " in out
