"""`qwen-trt build` against the fake tensorrt_llm 1.2.1 and a pretend GPU, on the tiny model."""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_trtllm.support import calls, fake_trtllm, set_gpu  # noqa: E402,F401

from qwen_trt.engine.profiles import default_profiles_dir, load_profile  # noqa: E402
from qwen_trt.cli import main  # noqa: E402
from qwen_trt.engine.build import BuildError, BuildRequest, run_build  # noqa: E402
from qwen_trt.engine.manifest import checkpoint_files, read_manifest  # noqa: E402


@pytest.fixture
def dirs(tmp_path):
    profiles = tmp_path / "profiles"
    shutil.copytree(default_profiles_dir(), profiles)
    return {"out": tmp_path / "out", "engines": tmp_path / "engines", "profiles": profiles}


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    """A private copy of the tiny checkpoint that tests may edit."""
    dest = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, dest)
    return dest


def _req(dirs, model, gpu="a10", force=False):
    return BuildRequest(gpu=gpu, model=str(model), out_dir=dirs["out"],
                        engines_dir=dirs["engines"], profiles_dir=dirs["profiles"], force=force)


def _run(dirs, model, **kw):
    lines: list[str] = []
    result = run_build(_req(dirs, model, **kw), write=lines.append)
    return result, lines


def test_build_produces_a_self_contained_engine_folder(fake_trtllm, monkeypatch, dirs, model_copy):
    gpu = set_gpu(monkeypatch, "a10")
    result, lines = _run(dirs, model_copy)
    eng = dirs["engines"] / "a10"
    assert result.engine_dir == eng
    for f in ("config.json", "rank0.engine", "manifest.json", "tokenizer/tokenizer.json",
              "tokenizer/tokenizer_config.json"):
        assert (eng / f).is_file(), f
    assert (dirs["out"] / "a10" / "checkpoint" / "rank0.safetensors").is_file()
    assert not any(p.name.endswith(".building") for p in dirs["engines"].iterdir())
    # one progress line per stage, with timings
    assert [ln.split()[0] for ln in lines if ln.endswith(" s")] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]

    m = read_manifest(eng)
    assert m["gpu"] == {"name": gpu.name, "compute_capability": "8.6",
                        "memory_gib": round(gpu.memory_gib, 2)}
    assert m["versions"]["tensorrt_llm"] == "1.2.1" and m["versions"]["tensorrt"] == "10.13.3.9"
    assert m["profile"]["name"] == "a10"
    prof = load_profile("a10", dirs["profiles"])
    assert m["limits"]["max_seq_len"] == prof.build.max_seq_len
    assert m["runtime"]["kv_cache_free_gpu_memory_fraction"] == \
        prof.runtime.kv_cache_free_gpu_memory_fraction
    assert m["build_flags"]["plugin_config"]["gemm_plugin"] == "float16"
    assert m["model"]["source"] == str(model_copy)
    assert m["model"]["shape"]["head_dim"] == 32          # tiny model: != hidden/heads = 16
    h = hashlib.sha256()
    for f in checkpoint_files(model_copy):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    assert m["model"]["checkpoint_sha256"] == h.hexdigest()
    assert set(m["timings_s"]) >= {"resolve", "export", "build", "total"}
    tok = json.loads((model_copy / "tokenizer_config.json").read_text())
    assert m["tokenizer"]["end_id"] != m["tokenizer"]["pad_id"]
    assert "tokenizer.json" in m["tokenizer"]["files"] and tok


def test_trtllm_is_called_with_the_profile_settings(fake_trtllm, monkeypatch, dirs, model_copy):
    set_gpu(monkeypatch, "a10")
    _run(dirs, model_copy)
    prof = load_profile("a10", dirs["profiles"])
    (hf,) = calls(fake_trtllm, "from_hugging_face")
    from qwen_trt.engine.build import needs_legacy_config

    hf_cfg = json.loads((model_copy / "config.json").read_text())
    staged = dirs["out"] / "a10" / "hf-staging"
    assert hf["dir"] == str(staged if needs_legacy_config(hf_cfg) else model_copy)
    assert hf["dtype"] == "float16"
    ckpt = json.loads((dirs["out"] / "a10" / "checkpoint" / "config.json").read_text())
    assert ckpt["rotary_base"] == 5_000_000.0 and ckpt["head_size"] == 32
    assert hf["mapping"].world_size == 1 and hf["mapping"].tp_size == 1
    (b,) = calls(fake_trtllm, "build")
    bc = b["build_config"]
    from tensorrt_llm.bindings import KVCacheType

    assert (bc.max_batch_size, bc.max_input_len, bc.max_seq_len, bc.max_num_tokens,
            bc.max_beam_width) == (prof.build.max_batch_size, prof.build.max_input_len,
                                   prof.build.max_seq_len, prof.build.max_num_tokens, 1)
    assert bc.kv_cache_type is KVCacheType.PAGED
    pc = bc.plugin_config
    assert (pc.gpt_attention_plugin, pc.gemm_plugin, pc.remove_input_padding, pc.context_fmha,
            pc.use_paged_context_fmha) == ("float16", "float16", True, True, True)
    # the engine TensorRT-LLM wrote keeps the explicit max_seq_len (tiny model default: 4096)
    cfg = json.loads((dirs["engines"] / "a10" / "config.json").read_text())
    assert cfg["build_config"]["max_seq_len"] == prof.build.max_seq_len != 4096
    assert cfg["build_config"]["kv_cache_type"] == "PAGED"
    assert cfg["pretrained_config"]["head_size"] == 32


def test_unchanged_inputs_skip_stages_and_force_reruns(fake_trtllm, monkeypatch, dirs, model_copy):
    set_gpu(monkeypatch, "a10")
    _run(dirs, model_copy)
    first = (dirs["engines"] / "a10" / "rank0.engine").stat().st_mtime_ns
    res, lines = _run(dirs, model_copy)
    assert res.skipped == ["export", "build", "verify"]
    assert sum("skipped" in ln for ln in lines) == 2
    assert len(calls(fake_trtllm, "build")) == 1 and len(calls(fake_trtllm, "from_hugging_face")) == 1
    assert (dirs["engines"] / "a10" / "rank0.engine").stat().st_mtime_ns == first

    # a run-time setting needs no new engine: only the manifest changes
    p = dirs["profiles"] / "a10.toml"
    p.write_text(p.read_text().replace("kv_cache_free_gpu_memory_fraction = 0.85",
                                       "kv_cache_free_gpu_memory_fraction = 0.7"))
    res, _ = _run(dirs, model_copy)
    assert res.skipped == ["export", "build", "verify"] and len(calls(fake_trtllm, "build")) == 1
    assert read_manifest(dirs["engines"] / "a10")["runtime"]["kv_cache_free_gpu_memory_fraction"] == 0.7

    # a profile edit rebuilds the engine but reuses the exported checkpoint
    p = dirs["profiles"] / "a10.toml"
    p.write_text(p.read_text().replace("max_batch_size = 8", "max_batch_size = 2"))
    res, _ = _run(dirs, model_copy)
    assert res.skipped == ["export"] and "build" in res.ran
    assert len(calls(fake_trtllm, "from_hugging_face")) == 1
    assert read_manifest(dirs["engines"] / "a10")["limits"]["max_batch_size"] == 2

    # a checkpoint change re-exports
    cfg = model_copy / "config.json"
    cfg.write_text(cfg.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    res, _ = _run(dirs, model_copy)
    assert res.skipped == [] and len(calls(fake_trtllm, "from_hugging_face")) == 2

    res, _ = _run(dirs, model_copy, force=True)
    assert res.skipped == [] and len(calls(fake_trtllm, "build")) == 4


def test_verify_rejects_an_engine_without_the_asked_max_seq_len(fake_trtllm, monkeypatch, dirs,
                                                                 model_copy):
    set_gpu(monkeypatch, "a10")
    import tensorrt_llm.builder as fb

    real = fb.build

    def forgetful(model, bc):  # what happens when max_seq_len is not passed through
        bc.max_seq_len = None
        return real(model, bc)

    monkeypatch.setattr(fb, "build", forgetful)
    with pytest.raises(BuildError, match=r"build_config.max_seq_len = 4096, asked 16384"):
        _run(dirs, model_copy)
    assert not (dirs["engines"] / "a10").exists()


def test_transformers5_config_layout_is_staged_for_the_converter(fake_trtllm, monkeypatch, dirs,
                                                                  model_copy):
    """transformers 5 writes rope_parameters.rope_theta; TensorRT-LLM reads rope_theta."""
    set_gpu(monkeypatch, "a10")
    cfg = json.loads((model_copy / "config.json").read_text())
    theta = cfg.pop("rope_theta", None) or cfg["rope_parameters"]["rope_theta"]
    cfg["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    (model_copy / "config.json").write_text(json.dumps(cfg))
    _run(dirs, model_copy)
    staged = json.loads((dirs["out"] / "a10" / "hf-staging" / "config.json").read_text())
    assert staged["rope_theta"] == theta
    assert (dirs["out"] / "a10" / "hf-staging" / "model.safetensors").resolve() == \
        (model_copy / "model.safetensors").resolve()

    # without the staging, the converter's default RoPE base is caught by the export check
    import qwen_trt.engine.build as eb

    monkeypatch.setattr(eb, "needs_legacy_config", lambda config: False)
    with pytest.raises(BuildError, match=r"rotary_base 100000.0 \(checkpoint rope_theta: 5e\+06\)"):
        _run(dirs, model_copy, force=True)


def _cli(capsys, *args):
    rc = main(["build", *args])
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.parametrize("version", ["1.3.0rc21", "1.3.0", "1.4.0rc4"])
def test_guard_release_without_engine_builder(fake_trtllm, monkeypatch, dirs, model_copy, capsys,
                                              version):
    set_gpu(monkeypatch, "a10")
    monkeypatch.setattr(fake_trtllm, "__version__", version)
    rc, err = _cli(capsys, "--gpu", "a10", "--model", str(model_copy),
                   "--profiles-dir", str(dirs["profiles"]))
    assert rc == 2
    assert err.startswith(f"qwen-trt: error: tensorrt_llm {version} builds and runs no "
                          f"TensorRT engines (the "
                          f"TensorRT backend was removed after 1.3.0rc20)")
    assert "--backend trtllm --model <checkpoint>" in err
    assert 'pip install -e ".[trtllm]"' in err and err.count("\n") == 0
    assert calls(fake_trtllm, "from_hugging_face") == []


def test_guard_no_gpu(fake_trtllm, monkeypatch, dirs, model_copy, capsys):
    set_gpu(monkeypatch, None)
    rc, err = _cli(capsys, "--gpu", "a10", "--model", str(model_copy),
                   "--profiles-dir", str(dirs["profiles"]))
    assert rc == 2 and "No NVIDIA GPU is visible to PyTorch" in err and err.count("\n") == 0


def test_guard_gpu_does_not_match_profile(fake_trtllm, monkeypatch, dirs, model_copy, capsys):
    set_gpu(monkeypatch, "h200")
    rc, err = _cli(capsys, "--gpu", "a10", "--model", str(model_copy),
                   "--profiles-dir", str(dirs["profiles"]))
    assert rc == 2
    assert "This GPU is an H200 (sm90); profile a10 wants sm86: run `make engine GPU=h200`" in err


def test_guard_same_sm_other_card(fake_trtllm, monkeypatch, dirs, model_copy, capsys):
    set_gpu(monkeypatch, "h100")
    rc, err = _cli(capsys, "--gpu", "h200", "--model", str(model_copy),
                   "--profiles-dir", str(dirs["profiles"]))
    assert rc == 2 and "profile h200 wants a GPU named like" in err and "GPU=h100" in err


def test_guard_not_enough_disk(fake_trtllm, monkeypatch, dirs, model_copy, capsys):
    set_gpu(monkeypatch, "a10")
    import qwen_trt.engine.env as env

    monkeypatch.setattr(env, "free_bytes", lambda path: 10**8)
    rc, err = _cli(capsys, "--gpu", "a10", "--model", str(model_copy),
                   "--profiles-dir", str(dirs["profiles"]), "--out-dir", str(dirs["out"]),
                   "--engines-dir", str(dirs["engines"]))
    assert rc == 2 and "Not enough disk space for the TensorRT-LLM checkpoint" in err
    assert "0.1 GB free" in err
    assert calls(fake_trtllm, "from_hugging_face") == []


def test_guard_missing_head_dim(fake_trtllm, monkeypatch, dirs, model_copy, capsys):
    """One head_dim policy (model/shape.py): omitted = hidden/heads, which for a Qwen3-4B-sized
    config is the 80-not-128 trap the build refuses before converting anything."""
    set_gpu(monkeypatch, "a10")
    # the tiny weights do not fit a 4B-sized config (resolve_model says so): not this guard's case
    monkeypatch.setattr("qwen_trt.model.source.check_weights", lambda files, shape: None)
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["head_dim"]
    cfg.update(num_hidden_layers=36, hidden_size=2560, num_attention_heads=32)
    (model_copy / "config.json").write_text(json.dumps(cfg))
    rc, err = _cli(capsys, "--gpu", "a10", "--model", str(model_copy),
                   "--profiles-dir", str(dirs["profiles"]), "--out-dir", str(dirs["out"]),
                   "--engines-dir", str(dirs["engines"]))
    assert rc == 2 and "head_dim 80 (head_dim missing: hidden/heads)" in err
    assert "the real model has head_dim 128" in err
    assert calls(fake_trtllm, "from_hugging_face") == []


def test_qwen3_4b_head_dim_trap_is_caught():
    from qwen_trt.engine.build import check_model_shapes
    from qwen_trt.errors import ModelSourceError

    cfg = {"num_hidden_layers": 36, "hidden_size": 2560, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 151936, "head_dim": 128,
           "intermediate_size": 9728,
           "max_position_embeddings": 262144, "tie_word_embeddings": True}
    assert check_model_shapes(cfg).head_dim == 128
    with pytest.raises(ModelSourceError, match="the real model has head_dim 128"):
        check_model_shapes({**cfg, "head_dim": 80})
    with pytest.raises(ModelSourceError, match="not a multiple"):
        check_model_shapes({**cfg, "num_key_value_heads": 7})


# ---------------------------------------------------------------- issue #12 regressions

@pytest.fixture
def early_converter(fake_trtllm, monkeypatch):
    """The 1.0.0rc3 converter: head_dim = hidden // heads unless kv_channels is given."""
    import tensorrt_llm.models.qwen.config as qc

    monkeypatch.setattr(qc, "FLAVOUR", "1.0rc3")
    return qc


def test_early_converter_gets_the_head_size_from_kv_channels(early_converter, monkeypatch, dirs,
                                                             model_copy):
    set_gpu(monkeypatch, "a10")
    _run(dirs, model_copy)
    staged = json.loads((dirs["out"] / "a10" / "hf-staging" / "config.json").read_text())
    assert staged["kv_channels"] == staged["head_dim"] == 32        # tiny: hidden/heads = 16
    ckpt = json.loads((dirs["out"] / "a10" / "checkpoint" / "config.json").read_text())
    assert ckpt["head_size"] == 32
    eng = json.loads((dirs["engines"] / "a10" / "config.json").read_text())
    assert eng["pretrained_config"]["head_size"] == 32


def test_without_kv_channels_the_early_converter_is_stopped_before_loading_weights(
        early_converter, monkeypatch, dirs, model_copy):
    import qwen_trt.engine.build as eb

    set_gpu(monkeypatch, "a10")
    real = eb.converter_config

    def without_kv_channels(config, shape):
        cfg = real(config, shape)
        cfg.pop("kv_channels")
        return cfg

    monkeypatch.setattr(eb, "converter_config", without_kv_channels)
    with pytest.raises(BuildError, match=r"read .* as head_size 16 \(checkpoint: 32\)"):
        _run(dirs, model_copy)
    assert calls(fake_trtllm_module(), "from_hugging_face") == []   # no weights were loaded
    # and what the user would have hit without the config check: upstream's shape assertion
    monkeypatch.setattr(eb, "check_converter_config", lambda cfg, shape, where: None)
    with pytest.raises(BuildError, match=r"The value updated is not the same shape as the "
                                         r"original. Updated: \(256, 64\), original: \(128, 64\)"):
        _run(dirs, model_copy, force=True)


def fake_trtllm_module():
    import tensorrt_llm

    return tensorrt_llm


def test_timing_cache_goes_to_the_work_folder_not_the_cwd(fake_trtllm, monkeypatch, dirs,
                                                          model_copy, tmp_path):
    set_gpu(monkeypatch, "a10")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    _run(dirs, model_copy)
    assert list(cwd.iterdir()) == []                          # BuildConfig default: ./model.cache
    cache = dirs["out"] / "a10" / "model.cache"
    assert cache.is_file()
    (first,) = calls(fake_trtllm, "build")
    assert first["build_config"].output_timing_cache == str(cache)
    assert first["build_config"].input_timing_cache is None   # nothing to read on the first build
    _run(dirs, model_copy, force=True)
    assert calls(fake_trtllm, "build")[1]["build_config"].input_timing_cache == str(cache)


def test_manifest_says_the_tied_embedding_is_stored_twice(fake_trtllm, monkeypatch, dirs,
                                                          model_copy):
    set_gpu(monkeypatch, "a10")
    m = _run(dirs, model_copy)[0].manifest
    cfg = json.loads((model_copy / "config.json").read_text())
    w = m["weights"]
    assert cfg["tie_word_embeddings"] and w["tied_embeddings"] and w["lm_head_stored_separately"]
    vocab_x_hidden = cfg["vocab_size"] * cfg["hidden_size"]
    params = w["checkpoint_params"]
    assert w["estimated_bytes"] == (params + vocab_x_hidden) * 2
    # the fake plan carries the converted weights, as a real engine does: the estimate holds
    engine = (dirs["engines"] / "a10" / "rank0.engine").stat().st_size
    assert w["engine_file_bytes"] == engine
    assert abs(engine - w["estimated_bytes"]) < 0.15 * w["estimated_bytes"]


def test_bfloat16_override_builds_its_own_engine_folder(fake_trtllm, monkeypatch, dirs,
                                                       model_copy):
    set_gpu(monkeypatch, "a10")
    fp16, _ = _run(dirs, model_copy)
    bf16 = run_build(BuildRequest(gpu="a10", model=str(model_copy), out_dir=dirs["out"],
                                  engines_dir=dirs["engines"], profiles_dir=dirs["profiles"],
                                  dtype="bfloat16"), write=lambda s: None)
    assert fp16.engine_dir.name == "a10" and bf16.engine_dir.name == "a10-bf16"
    assert (fp16.manifest["dtype"], bf16.manifest["dtype"]) == ("float16", "bfloat16")
    assert bf16.manifest["build_flags"]["plugin_config"]["gemm_plugin"] == "bfloat16"
    assert read_manifest(dirs["engines"] / "a10")["dtype"] == "float16"    # untouched
    hf = calls(fake_trtllm, "from_hugging_face")
    assert [c["dtype"] for c in hf] == ["float16", "bfloat16"]
    cfg = json.loads((dirs["engines"] / "a10-bf16" / "config.json").read_text())
    assert cfg["pretrained_config"]["dtype"] == "bfloat16"
    assert cfg["build_config"]["plugin_config"]["gpt_attention_plugin"] == "bfloat16"


def test_bfloat16_needs_ampere(fake_trtllm, monkeypatch, dirs, model_copy, capsys):
    from qwen_trt.engine import gpu as gpu_mod

    t4 = gpu_mod.GpuInfo("Tesla T4", (7, 5), 14.6)
    monkeypatch.setattr(gpu_mod, "detect_gpu", lambda index=0: t4)
    p = dirs["profiles"] / "t4.toml"
    p.write_text((dirs["profiles"] / "a10.toml").read_text()
                 .replace("'\\bA10\\b'", "'T4'").replace('"8.6"', '"7.5"')
                 .replace("memory_gib = 22", "memory_gib = 14"))
    rc = main(["build", "--gpu", "t4", "--dtype", "bfloat16", "--model", str(model_copy),
               "--profiles-dir", str(dirs["profiles"]), "--out-dir", str(dirs["out"]),
               "--engines-dir", str(dirs["engines"])])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--dtype bfloat16 needs an Ampere or newer GPU (sm80+)" in err
    assert "sm75" in err and err.count("\n") == 0
    assert calls(fake_trtllm, "from_hugging_face") == []


def test_container_image_is_recorded(fake_trtllm, monkeypatch, dirs, model_copy):
    set_gpu(monkeypatch, "a10")
    monkeypatch.setenv("QWEN_TRT_IMAGE", "nvcr.io/nvidia/tensorrt-llm/release:1.2.1")
    m = _run(dirs, model_copy)[0].manifest
    assert m["container"] == {"image": "nvcr.io/nvidia/tensorrt-llm/release:1.2.1"}
    monkeypatch.delenv("QWEN_TRT_IMAGE")
    assert _run(dirs, model_copy, force=True)[0].manifest["container"] is None


def test_verify_catches_tensorrt_llm_clipping_max_num_tokens(fake_trtllm, monkeypatch, dirs,
                                                             model_copy):
    """build() clips max_num_tokens to max_batch_size x max_seq_len (check_max_num_tokens);
    profiles reject such values, and verify would catch one that slipped through."""
    import dataclasses

    import qwen_trt.engine.build as eb

    set_gpu(monkeypatch, "a10")
    prof = load_profile("a10", dirs["profiles"])
    odd = dataclasses.replace(prof, build=dataclasses.replace(
        prof.build, max_batch_size=1, max_seq_len=1024, max_input_len=512, max_num_tokens=4096))
    monkeypatch.setattr(eb, "load_profile", lambda name, d=None: odd)
    with pytest.raises(BuildError, match=r"build_config.max_num_tokens = 1024, asked 4096"):
        _run(dirs, model_copy)


@pytest.mark.parametrize("version", ["1.0.0", "1.1.0"])
def test_guard_trtllm_releases_that_pin_an_older_transformers(fake_trtllm, monkeypatch, dirs,
                                                              model_copy, capsys, version):
    set_gpu(monkeypatch, "a10")
    monkeypatch.setattr(fake_trtllm, "__version__", version)
    rc, err = _cli(capsys, "--gpu", "a10", "--model", str(model_copy),
                   "--profiles-dir", str(dirs["profiles"]))
    assert rc == 2 and f"tensorrt_llm {version} is installed" in err
    assert "1.0/1.1 pin a transformers older than 4.57" in err


def test_the_trtllm_extra_matches_the_supported_range():
    """pyproject's extra, the runtime check and transformers' range agree (1.2 pins 4.57)."""
    import re

    from qwen_trt.engine.env import TRTLLM_SPEC, version_supported

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    (extra,) = re.findall(r'^trtllm = \["([^"]+)"\]', text, flags=re.M)
    assert extra == TRTLLM_SPEC == "tensorrt_llm>=1.2,<1.3"
    assert re.search(r'"transformers>=4\.57,', text)
    assert [version_supported(v) for v in ("1.0.0", "1.1.0", "1.2.0", "1.2.1", "1.3.0rc20")] == \
        [False, False, True, True, False]
