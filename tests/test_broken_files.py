"""Broken files are one line naming the file and what is wrong: checkpoint
files (weights, config, tokenizer), engine manifests and build profiles, in the library, the
CLI (chat, build, export-onnx) and the app."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from qwen_trt.cli import main
from qwen_trt.errors import QwenTrtError
from qwen_trt.model.source import resolve_model


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _corrupt_header(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[8:20] = b"garbage!!!!!"
    p.write_bytes(bytes(data))


def _edit_config(**changes):
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


def _sharded_missing(d: Path) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))


CHECKPOINT_CASES = {
    "empty-weights": ("model.safetensors", lambda d: (d / "model.safetensors").write_bytes(b""),
                      "is empty or shorter than a header"),
    "truncated-weights": ("model.safetensors", lambda d: _truncate(d / "model.safetensors"),
                          "is truncated"),
    "corrupt-weights": ("model.safetensors", lambda d: _corrupt_header(d / "model.safetensors"),
                        "is corrupt (its header is not valid JSON)"),
    "missing-shard": ("model-00002-of-00002.safetensors", _sharded_missing, "is missing"),
    "config-list": ("config.json", lambda d: (d / "config.json").write_text("[1, 2]"),
                    "is not a JSON object (it holds a list)"),
    "config-null": ("config.json", lambda d: (d / "config.json").write_text("null"),
                    "is not a JSON object"),
    "config-string-int": ("config.json", _edit_config(hidden_size="64"),
                          "'hidden_size' must be a positive whole number, got '64'"),
    "config-bool-int": ("config.json", _edit_config(num_hidden_layers=True),
                        "'num_hidden_layers' must be a positive whole number, got True"),
    "config-wrong-type": ("config.json", _edit_config(tie_word_embeddings="yes"),
                          "'tie_word_embeddings' must be true or false, got 'yes'"),
    "config-rope-string": ("config.json", _edit_config(rope_theta="1e6"),
                           "'rope_theta' is '1e6'; expected a number"),
    "config-not-utf8": ("config.json", lambda d: (d / "config.json").write_bytes(b"{\"a\xff\": 1}"),
                        "is not valid JSON"),
    "tokenizer-invalid": ("tokenizer.json",
                          lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "model": 5}'),
                          "is not a valid tokenizer"),
    "tokenizer-config-list": ("tokenizer_config.json",
                              lambda d: (d / "tokenizer_config.json").write_text("[]"),
                              "is not a JSON object"),
}


@pytest.fixture
def broken(tiny_model_dir, tmp_path):
    def make(case: str) -> tuple[Path, str, str]:
        name, edit, needle = CHECKPOINT_CASES[case]
        d = tmp_path / case
        shutil.copytree(tiny_model_dir, d)
        edit(d)
        return d, str(d / name), needle
    return make


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_broken_checkpoint_file_is_named(broken, case):
    d, file, needle = broken(case)
    with pytest.raises(QwenTrtError) as e:    # ModelSourceError, ConfigError (shape fields)
        resolve_model(str(d))
    msg = str(e.value)
    assert file in msg and needle in msg and "\n" not in msg


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if x != "loading model..."]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("qwen-trt: error:"), err
    return err


def test_cli_chat_and_export_onnx_name_the_broken_file(broken, capsys, tmp_path):
    d, file, _ = broken("truncated-weights")
    assert main(["chat", "--model", str(d), "--prompt", "hi", "--backend", "torch"]) == 2
    assert file in _one_line(capsys)
    assert main(["export-onnx", "--model", str(d), "--out", str(tmp_path / "onnx")]) == 2
    assert file in _one_line(capsys)
    d, file, _ = broken("tokenizer-invalid")
    assert main(["chat", "--model", str(d), "--prompt", "hi", "--backend", "torch"]) == 2
    assert f"{file} is not a valid tokenizer" in _one_line(capsys)


def test_app_names_the_broken_file(broken, monkeypatch):
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    d, file, _ = broken("config-list")
    st.cache_resource.clear()
    monkeypatch.setattr(sys, "argv", ["app.py", "--model", str(d), "--device", "cpu"])
    try:
        at = AppTest.from_file(str(Path(__file__).parents[1] / "app.py"), default_timeout=60).run()
    finally:
        st.cache_resource.clear()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.error) == 1 and file in at.error[0].value
    assert "is not a JSON object" in at.error[0].value


# -- engine manifests ---------------------------------------------------------------------------

def _good_manifest() -> dict:
    return {"format": 1, "gpu": {"name": "NVIDIA A10", "compute_capability": "8.6",
                                 "memory_gib": 22.0},
            "versions": {"tensorrt_llm": "1.2.0", "tensorrt": "10.13.0"},
            "profile": {"name": "a10"}, "model": {"source": "Qwen/Qwen3-4B-Instruct-2507"},
            "limits": {"max_batch_size": 4, "max_input_len": 15360, "max_seq_len": 16384,
                       "max_num_tokens": 8192, "max_beam_width": 1},
            "runtime": {"kv_cache_free_gpu_memory_fraction": 0.85,
                        "kv_cache_enable_block_reuse": True, "enable_chunked_context": True}}


def _set(path: str, value):
    def edit(m):
        *parents, last = path.split(".")
        for p in parents:
            m = m[p]
        m[last] = value
    return edit


@pytest.mark.parametrize("edit, needle", [
    ("null", "holds null, not a JSON object"),
    ("[]", "holds a list, not a JSON object"),
    (_set("gpu", "A10"), "'gpu' is 'A10' (a string); expected an object"),
    (_set("versions", None), "'versions' is None (null); expected an object"),
    (_set("versions.tensorrt", 10), "'versions.tensorrt' is 10; expected a version string"),
    (_set("gpu.compute_capability", 8.6), "'gpu.compute_capability' is 8.6; expected a string"),
    (_set("limits.max_batch_size", "4"), "'limits.max_batch_size' is '4'"),
    (_set("limits.max_seq_len", 10**30), "'limits.max_seq_len' is 1000000000000000000000000000000"),
    (_set("runtime.kv_cache_free_gpu_memory_fraction", float("nan")), "fraction in (0, 1]"),
    (_set("model", "Qwen"), "'model' is 'Qwen' (a string); expected an object"),
    (b"{\"gpu\": \"\xff\"}", "is unreadable"),
])
def test_broken_manifest_is_named(tmp_path, edit, needle):
    from qwen_trt.backends import engine_built_from
    from qwen_trt.engine.manifest import ManifestError, read_manifest

    path = tmp_path / "manifest.json"
    if isinstance(edit, bytes):
        path.write_bytes(edit)
    elif isinstance(edit, str):
        path.write_text(edit)
    else:
        m = _good_manifest()
        edit(m)
        path.write_text(json.dumps(m))
    with pytest.raises(ManifestError) as e:
        read_manifest(tmp_path)
    msg = str(e.value)
    assert str(path) in msg and needle in msg and "\n" not in msg
    assert engine_built_from(tmp_path, "Qwen") is False          # no traceback either


def test_good_manifest_reads(tmp_path):
    from qwen_trt.engine.manifest import read_manifest

    (tmp_path / "manifest.json").write_text(json.dumps(_good_manifest()))
    assert read_manifest(tmp_path)["limits"]["max_batch_size"] == 4


# -- build profiles -----------------------------------------------------------------------------

PROFILES = Path(__file__).resolve().parents[1] / "build" / "profiles"


@pytest.mark.parametrize("edit, needle", [
    (lambda t: t.replace("memory_gib = 22", "memory_gib = inf"), "[gpu].memory_gib = inf"),
    (lambda t: t.replace("memory_gib = 22", "memory_gib = nan"), "[gpu].memory_gib = nan"),
    (lambda t: t.replace("max_batch_size = 8", "max_batch_size = 1000000000000"),
     "[build].max_batch_size = 1000000000000; expected an integer from 1 to 2048"),
    (lambda t: t.replace("max_num_tokens = 8192", "max_num_tokens = 9223372036854775807"),
     "[build].max_num_tokens = 9223372036854775807"),
    (lambda t: t.encode("utf-8").replace(b"NVIDIA A10 (", b"NVIDIA A10 \xff("),
     "is not UTF-8 text (byte 0xff"),
])
def test_broken_profile_is_named(tmp_path, capsys, edit, needle):
    from qwen_trt.engine.profiles import ProfileError, load_profile

    original = (PROFILES / "a10.toml").read_text()
    text = edit(original)
    assert text not in (original, original.encode())           # the edit applies
    path = tmp_path / "a10.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ProfileError) as e:
        load_profile("a10", tmp_path)
    assert str(path) in str(e.value) and needle in str(e.value)
    assert main(["build", "--list", "--profiles-dir", str(tmp_path)]) == 2
    assert needle in _one_line(capsys)


def test_a_folder_named_like_a_profile(tmp_path, capsys):
    from qwen_trt.engine.profiles import ProfileError, available_profiles, load_all, load_profile

    (tmp_path / "a10.toml").mkdir()
    shutil.copy(PROFILES / "l4.toml", tmp_path / "l4.toml")
    with pytest.raises(ProfileError, match="a10.toml is a folder, not a profile file"):
        load_profile("a10", tmp_path)
    with pytest.raises(ProfileError, match="is a folder, not a profile file"):
        load_profile(str(tmp_path / "a10.toml"))
    assert available_profiles(tmp_path) == ["l4"]
    assert [p.name for p in load_all(tmp_path)] == ["l4"]
    assert main(["build", "--gpu", "a10", "--profiles-dir", str(tmp_path),
                 "--model", str(tmp_path / "nope")]) == 2
    err = _one_line(capsys)
    assert "a10.toml is a folder" in err or "does not exist" in err


def test_every_shipped_profile_still_loads():
    from qwen_trt.engine.profiles import load_all

    assert len(load_all(PROFILES)) >= 7

