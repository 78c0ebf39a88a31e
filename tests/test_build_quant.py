"""Quantized engines (``make engine GPU=a10 QUANT=int4_awq``) by contract with the fake
tensorrt_llm 1.2.1: which upstream flow each quantization takes (ModelOpt ``quantize`` with a
named calibration set, or weight-only while converting), the folder, the manifest, and the
one-line refusals on a GPU that cannot run it."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_trtllm.support import calls, fake_trtllm, set_gpu  # noqa: E402,F401

from qwen_trt.cli import main  # noqa: E402
from qwen_trt.engine.build import BuildError, BuildRequest, run_build  # noqa: E402
from qwen_trt.engine.profiles import default_profiles_dir  # noqa: E402


@pytest.fixture
def dirs(tmp_path):
    profiles = tmp_path / "profiles"
    shutil.copytree(default_profiles_dir(), profiles)
    return {"out": tmp_path / "out", "engines": tmp_path / "engines", "profiles": profiles}


def _build(dirs, model, gpu="a10", quant=None):
    return run_build(BuildRequest(gpu=gpu, model=str(model), out_dir=dirs["out"],
                                  engines_dir=dirs["engines"], profiles_dir=dirs["profiles"],
                                  quant=quant), write=lambda s: None)


def test_int4_awq_is_calibrated_by_modelopt_into_its_own_folder(fake_trtllm, monkeypatch, dirs,
                                                                tiny_model_dir):
    set_gpu(monkeypatch, "a10")
    res = _build(dirs, tiny_model_dir, quant="int4_awq")
    assert res.engine_dir == dirs["engines"] / "a10-int4_awq"
    (q,) = calls(fake_trtllm, "quantize")
    assert q["quant_config"].quant_algo.value == "W4A16_AWQ"
    assert q["quant_config"].kv_cache_quant_algo is None and q["quant_config"].group_size == 128
    assert (q["calib_dataset"], q["calib_batches"], q["calib_max_seq_length"]) == \
        ("cnn_dailymail", 512, 512)
    assert q["output_dir"] == str(dirs["out"] / "a10-int4_awq" / "checkpoint")
    m = res.manifest
    assert m["quantization"]["name"] == "int4_awq" and m["quantization"]["quant_algo"] == "W4A16_AWQ"
    assert m["quantization"]["calibration"] == {"dataset": "cnn_dailymail", "batches": 512,
                                                "max_seq_length": 512}
    assert m["build_flags"]["quantization"] == m["quantization"]
    engine_cfg = json.loads((res.engine_dir / "config.json").read_text())
    assert engine_cfg["pretrained_config"]["quantization"]["quant_algo"] == "W4A16_AWQ"
    assert m["limits"]["max_batch_size"] == 8            # the a10 profile's limits


def test_weight_only_int8_converts_natively_and_is_smaller(fake_trtllm, monkeypatch, dirs,
                                                           tiny_model_dir):
    set_gpu(monkeypatch, "a10")
    fp16 = _build(dirs, tiny_model_dir)
    wo = _build(dirs, tiny_model_dir, quant="int8_wo")
    assert calls(fake_trtllm, "quantize") == []          # no calibration for weight-only
    hf = calls(fake_trtllm, "from_hugging_face")
    assert [c["quant_config"] and c["quant_config"].quant_algo.value for c in hf] == \
        [None, "W8A16"]
    assert wo.engine_dir.name == "a10-int8_wo" and fp16.manifest.get("quantization") is None
    w = wo.manifest["weights"]
    assert w["quantization"] == "int8_wo"
    assert w["engine_file_bytes"] < fp16.manifest["weights"]["engine_file_bytes"]
    assert abs(w["engine_file_bytes"] - w["estimated_bytes"]) < 0.15 * w["estimated_bytes"]


def test_fp8_on_an_a10_is_one_line(fake_trtllm, monkeypatch, dirs, tiny_model_dir, capsys):
    set_gpu(monkeypatch, "a10")
    rc = main(["build", "--gpu", "a10", "--quant", "fp8", "--model", str(tiny_model_dir),
               "--profiles-dir", str(dirs["profiles"]), "--out-dir", str(dirs["out"]),
               "--engines-dir", str(dirs["engines"])])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0, err
    assert ("QUANT=fp8 (FP8) needs an sm89+ GPU (L4, RTX 4090, H100, H200); this GPU is A10 "
            "(sm86): build QUANT=int4_awq or QUANT=int8_wo") in err
    assert calls(fake_trtllm, "from_hugging_face") == [] and calls(fake_trtllm, "quantize") == []


def test_fp8_on_an_l4(fake_trtllm, monkeypatch, dirs, tiny_model_dir):
    set_gpu(monkeypatch, "l4")
    res = _build(dirs, tiny_model_dir, gpu="l4", quant="fp8")
    assert res.engine_dir.name == "l4-fp8" and res.manifest["quantization"]["quant_algo"] == "FP8"
    assert res.manifest["quantization"]["min_compute_capability"] == "8.9"


def test_verify_catches_a_converter_that_ignored_the_quantization(fake_trtllm, monkeypatch, dirs,
                                                                 tiny_model_dir):
    from tensorrt_llm.models.qwen.config import QWenConfig

    set_gpu(monkeypatch, "a10")
    orig = QWenConfig.from_hugging_face.__func__

    def ignoring(cls, d, dtype="auto", mapping=None, quant_config=None, **kw):
        return orig(cls, d, dtype=dtype, mapping=mapping, quant_config=None, **kw)

    monkeypatch.setattr(QWenConfig, "from_hugging_face", classmethod(ignoring))
    with pytest.raises(BuildError, match=r"quantization None \(asked W4A16\)"):
        _build(dirs, tiny_model_dir, quant="int4_wo")


def test_auto_pick_prefers_the_fp16_engine(fake_trtllm, monkeypatch, dirs, tiny_model_dir):
    from qwen_trt.backends.trtllm_backend import find_engine_dir

    gpu = set_gpu(monkeypatch, "a10")
    _build(dirs, tiny_model_dir, quant="int8_wo")
    assert find_engine_dir(gpu, dirs["engines"]) == dirs["engines"] / "a10-int8_wo"   # the only
    fp16 = _build(dirs, tiny_model_dir).engine_dir
    moved = fp16.rename(dirs["engines"] / "zz-last-by-name")          # not a matter of names
    assert find_engine_dir(gpu, dirs["engines"]) == moved


def test_a_quantized_engine_on_a_gpu_that_cannot_run_it(fake_trtllm, monkeypatch, dirs,
                                                        tiny_model_dir):
    from qwen_trt.backends.trtllm import load_trtllm
    from qwen_trt.errors import EngineMismatchError

    set_gpu(monkeypatch, "l4")
    engine = _build(dirs, tiny_model_dir, gpu="l4", quant="fp8").engine_dir
    set_gpu(monkeypatch, "a10")
    with pytest.raises(EngineMismatchError) as e:
        load_trtllm(engine=str(engine), warmup=False)
    msg = str(e.value)
    assert msg == (f"Engine {engine} cannot run here: its quantization fp8 (FP8) needs an sm89+ "
                   f"GPU (L4, RTX 4090, H100, H200); this GPU is A10 (sm86): build "
                   f"QUANT=int4_awq or QUANT=int8_wo, or the FP16 engine.")
    assert calls(fake_trtllm, "ModelRunnerCpp.from_dir") == []


def test_the_make_target_passes_quant():
    text = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert "$(if $(QUANT),--quant $(QUANT))" in text
