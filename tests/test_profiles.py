"""Build profiles: the shipped files load, fit their GPU, and bad edits name the wrong key."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from qwen_trt.engine.profiles import ProfileError, default_profiles_dir, load_all, load_profile
from qwen_trt.engine.build import build_config_kwargs, plugin_settings
from qwen_trt.engine.gpu import GpuInfo, matching_profiles

sys.path.insert(0, str(Path(__file__).parent))
from fake_trtllm.support import GPUS  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REQUIRED = {"a10", "a10g", "l4", "a100", "h100", "h200", "rtx4090"}
# Qwen3-4B-Instruct-2507: FP16 engine weights (4.02 B params plus the tied 151936 x 2560 embedding
# stored again as lm_head) and KV bytes per token (36 layers, 8 KV heads, 128 dim)
WEIGHTS_GIB = (4.02e9 + 151936 * 2560) * 2 / 2**30
KV_BYTES_PER_TOKEN = 36 * 2 * 8 * 128 * 2
ACTIVATIONS_GIB = 2.0   # generous: workspace for max_num_tokens tokens per step


def test_every_required_gpu_has_a_valid_profile():
    profiles = {p.name: p for p in load_all()}
    assert REQUIRED <= set(profiles)


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_profile_becomes_the_build_settings_written_in_its_file(name):
    prof = load_profile(name)
    raw = tomllib.loads((default_profiles_dir() / f"{name}.toml").read_text())["build"]
    kw = build_config_kwargs(prof)
    for key in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
        assert kw[key] == raw[key]
    assert kw["kv_cache_type"] == "paged"
    # max_seq_len is explicit and far below the model's 262144 default
    assert kw["max_seq_len"] is not None and kw["max_seq_len"] <= 65536
    assert plugin_settings(prof) == {
        "gpt_attention_plugin": "float16", "gemm_plugin": "float16",
        "remove_input_padding": True, "context_fmha": True,
        "use_paged_context_fmha": raw["use_paged_context_fmha"]}
    assert prof.build.dtype == "float16"
    assert 0 < prof.runtime.kv_cache_free_gpu_memory_fraction < 1


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_profile_fits_its_card_memory(name):
    """Weights + activations + one full-length sequence of KV must fit the card it targets."""
    prof = load_profile(name)
    kv_one_seq = prof.build.max_seq_len * KV_BYTES_PER_TOKEN / 2**30
    need = WEIGHTS_GIB + ACTIVATIONS_GIB + kv_one_seq
    assert need < prof.gpu.memory_gib * 0.95, (name, need)
    # ...and the KV pool holds max_batch_size sequences of a quarter of max_seq_len at least
    pool = (prof.gpu.memory_gib - WEIGHTS_GIB - ACTIVATIONS_GIB) * \
        prof.runtime.kv_cache_free_gpu_memory_fraction
    assert pool * 2**30 / KV_BYTES_PER_TOKEN >= prof.build.max_batch_size * prof.build.max_seq_len / 4


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_the_advertised_concurrency_fits_the_kv_pool(name):
    """max_batch_size is what the trtllm backend advertises (requests in flight): the KV pool
    holds that many chats of 8k tokens at once."""
    prof = load_profile(name)
    pool = (prof.gpu.memory_gib - WEIGHTS_GIB - ACTIVATIONS_GIB) * \
        prof.runtime.kv_cache_free_gpu_memory_fraction
    assert pool * 2**30 / KV_BYTES_PER_TOKEN >= prof.build.max_batch_size * 8192, name
    assert prof.build.max_batch_size >= 4


def test_h200_advertises_the_benchmark_concurrency():
    assert load_profile("h200").build.max_batch_size == 32


@pytest.mark.parametrize("key,expected", [
    ("a10", "a10"), ("a10g", "a10g"), ("l4", "l4"), ("rtx4090", "rtx4090"), ("a100", "a100"),
    ("a100-40", "a100"), ("h100", "h100"), ("h200", "h200")])
def test_each_real_device_name_matches_exactly_one_profile(key, expected):
    gpu = GpuInfo(*GPUS[key])
    assert [p.name for p in matching_profiles(gpu, load_all())] == [expected]


def test_similar_names_do_not_match():
    profiles = load_all()
    for name, cc in (("NVIDIA L40S", (8, 9)), ("NVIDIA A40", (8, 6)), ("NVIDIA A16", (8, 6))):
        assert matching_profiles(GpuInfo(name, cc, 45.0), profiles) == []


GOOD = (default_profiles_dir() / "a10.toml").read_text()


def _write(tmp_path, text, name="x10"):
    p = tmp_path / f"{name}.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.replace("max_seq_len = 16384", 'max_seq_len = "16k"'),
     "[build].max_seq_len = '16k' should be an integer"),
    (lambda t: t.replace("max_seq_len = 16384\n", ""), "missing key [build].max_seq_len"),
    (lambda t: t.replace("max_num_tokens", "max_num_tokenz"), "unknown key [build].max_num_tokenz"),
    (lambda t: t.replace("max_input_len = 15360", "max_input_len = 16384"),
     "[build].max_input_len = 16384; expected less than max_seq_len (16384)"),
    (lambda t: t.replace('kv_cache_type = "paged"', 'kv_cache_type = "continuous"'),
     "[build].kv_cache_type = 'continuous'; expected \"paged\""),
    (lambda t: t.replace('gemm_plugin = "float16"', 'gemm_plugin = "int8"'),
     "[build].gemm_plugin = 'int8'; expected float16 or auto"),
    (lambda t: t.replace('dtype = "float16"', 'dtype = "bfloat16"'), "[build].dtype = 'bfloat16'"),
    (lambda t: t.replace('compute_capability = "8.6"', "compute_capability = 8.6"),
     "[gpu].compute_capability = 8.6 should be a string"),
    (lambda t: t.replace('compute_capability = "8.6"', 'compute_capability = "sm86"'),
     "[gpu].compute_capability = 'sm86'; expected a string like \"8.6\""),
    (lambda t: t.replace("remove_input_padding = true", "remove_input_padding = false"),
     "[build].remove_input_padding = False; expected true"),
    (lambda t: t.replace("kv_cache_free_gpu_memory_fraction = 0.85",
                         "kv_cache_free_gpu_memory_fraction = 1.5"),
     "[runtime].kv_cache_free_gpu_memory_fraction = 1.5"),
    (lambda t: t.replace("enable_chunked_context = true", "enable_chunked_context = false"),
     "[build].max_num_tokens = 8192; expected >= max_input_len (15360)"),
    (lambda t: t.replace("[runtime]", "[runtim]"), "unknown table or key 'runtim'"),
    (lambda t: t.replace("max_seq_len = 16384", "max_seq_len = 512").replace(
        "max_input_len = 15360", "max_input_len = 256").replace("max_batch_size = 8",
                                                                 "max_batch_size = 2"),
     "[build].max_num_tokens = 8192; expected at most max_batch_size x max_seq_len (1024)"),
    (lambda t: t.replace("[gpu]", "[gpu"), "is not valid TOML"),
])
def test_bad_profile_names_file_key_and_expectation(tmp_path, edit, needle):
    path = _write(tmp_path, edit(GOOD))
    with pytest.raises(ProfileError) as e:
        load_profile("x10", tmp_path)
    msg = str(e.value)
    assert str(path) in msg and needle in msg, msg
    assert "\n" not in msg


def test_optional_runtime_keys_take_defaults(tmp_path):
    text = GOOD.replace("kv_cache_enable_block_reuse = true", "").replace(
        "enable_chunked_context = true", "")
    prof = load_profile("x10", _write(tmp_path, text).parent)
    assert prof.runtime.kv_cache_enable_block_reuse is True
    assert prof.runtime.enable_chunked_context is True


def test_unknown_profile_lists_the_available_ones(tmp_path):
    _write(tmp_path, GOOD, "a10")
    with pytest.raises(ProfileError, match=r"No build profile 'b20' .*have: a10"):
        load_profile("b20", tmp_path)


def test_default_profiles_dir_does_not_depend_on_the_cwd(tmp_path, monkeypatch):
    monkeypatch.delenv("QWEN_TRT_PROFILES_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    d = default_profiles_dir()
    assert d.is_absolute() and (d / "h200.toml").is_file()
    assert d == Path(__file__).resolve().parents[1] / "build" / "profiles"
