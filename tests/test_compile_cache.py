"""The fast path's compile cache folder (qwen_trt/fast/compile_cache.py), on CPU."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from qwen_trt.fast.compile_cache import (CacheKey, CompileCache, cache_root,
                                         kernel_sources_hash, open_for_fast_path)

KEY = CacheKey(gpu="NVIDIA H200", capability="9.0", driver="13000", torch="2.11.0",
               triton="3.6.0", dtype="bfloat16", shapes='{"hidden": 2560}',
               weight_format="bf16-safetensors", buckets="max_batch=32",
               kernels=kernel_sources_hash())


class Config:
    def __init__(self, bn: int, warps: int) -> None:
        self.kwargs, self.num_warps, self.num_stages = {"BLOCK_N": bn}, warps, 3


class Tuner:       # a triton Autotuner's two attributes the cache uses
    def __init__(self) -> None:
        self.configs = [Config(16, 4), Config(32, 4), Config(64, 8)]
        self.cache: dict = {}


def test_key_changes_the_folder_and_the_kernel_hash_is_stable():
    assert KEY.digest() == replace(KEY).digest()
    for field, value in (("gpu", "NVIDIA H100"), ("triton", "3.5.0"), ("buckets", "max_batch=8"),
                         ("shapes", '{"hidden": 4096}'), ("kernels", "0" * 16),
                         ("weight_format", "fp8-block=128x128")):
        assert replace(KEY, **{field: value}).digest() != KEY.digest(), field
    assert kernel_sources_hash() == kernel_sources_hash()


def test_choices_round_trip_and_env_points_into_the_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    lines: list[str] = []
    c = CompileCache(tmp_path, KEY, lines.append).open()
    assert not c.warm
    import os

    assert os.environ["TRITON_CACHE_DIR"] == str(c.folder / "triton")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(c.folder / "inductor")
    t = Tuner()
    t.cache[(2560, 9728, 16, "torch.bfloat16")] = t.configs[2]
    t.cache[(2560, 2560, 32, "torch.bfloat16")] = t.configs[0]
    assert c.save_choices({"bgemm": t}) == 2
    c.seal()
    again = CompileCache(tmp_path, KEY, lines.append).open(set_env=False)
    assert again.warm and not lines
    fresh = Tuner()
    assert again.load_choices({"bgemm": fresh}) == 2
    assert fresh.cache[(2560, 9728, 16, "torch.bfloat16")] is fresh.configs[2]
    assert fresh.cache[(2560, 2560, 32, "torch.bfloat16")] is fresh.configs[0]


def test_a_stale_or_broken_folder_is_one_line_and_rebuilt(tmp_path):
    lines: list[str] = []
    c = CompileCache(tmp_path, KEY, lines.append).open(set_env=False)
    (c.folder / "triton" / "junk").write_text("x")
    c.seal()
    (c.folder / "key.json").write_text(json.dumps({"gpu": "something else"}))
    c2 = CompileCache(tmp_path, KEY, lines.append).open(set_env=False)
    assert not c2.warm and len(lines) == 1 and "does not match" in lines[0]
    assert not (c2.folder / "triton" / "junk").exists()
    c2.seal()
    (c2.folder / "autotune.json").write_text("{not json")
    t = Tuner()
    assert c2.load_choices({"bgemm": t}) == 0 and t.cache == {}
    assert len(lines) == 2 and "unreadable" in lines[1] and "\n" not in lines[1]
    (c2.folder / "autotune.json").write_text(json.dumps({"bgemm": {"(1, 2)": 7, "oops": 0}}))
    assert c2.load_choices({"bgemm": t}) == 0      # unknown config index, bad key: ignored


def test_root_from_flag_env_or_default(tmp_path):
    assert cache_root(str(tmp_path)) == tmp_path
    assert cache_root(None, {"QWEN_TRT_CACHE_DIR": str(tmp_path / "e")}) == tmp_path / "e"
    assert str(cache_root(None, {})).endswith(".cache/qwen-trt")


def test_no_cache_on_cpu(tmp_path):
    pytest.importorskip("torch")
    assert open_for_fast_path(object(), "float32", "cpu", cache_dir=str(tmp_path),
                              buckets="") is None
    assert not any(tmp_path.iterdir())


def test_warmup_picks_round_trip_and_only_known_values_are_used(tmp_path):
    lines: list[str] = []
    c = CompileCache(tmp_path, KEY, lines.append).open(set_env=False)
    c.remember("bucket_impl", 8, "bgemm")
    c.remember("varlen_tile", 64, [32, 8])
    assert c.save_choices({"bgemm": Tuner()}) == 2
    c.seal()
    again = CompileCache(tmp_path, KEY, lines.append).open(set_env=False)
    assert again.load_choices({"bgemm": Tuner()}) == 2
    assert again.pick("bucket_impl", 8, ("bgemm", "torch")) == "bgemm"
    assert again.pick("varlen_tile", 64, ((16, 4), (32, 8))) == (32, 8)    # JSON list -> tuple
    assert again.pick("bucket_impl", 8, ("torch",)) is None          # no longer an option
    assert again.pick("bucket_impl", 16, ("bgemm", "torch")) is None   # never timed
    assert again.picked == 2 and not lines
    (again.folder / "autotune.json").write_text(json.dumps({"_picks": ["not", "a", "dict"]}))
    third = CompileCache(tmp_path, KEY, lines.append).open(set_env=False)
    assert third.load_choices({}) == 0 and third.picks == {}


class _FakeGraph:
    def __init__(self, impl: str) -> None:
        self.impl = impl


def _cpu_batched(monkeypatch, cache):
    torch = pytest.importorskip("torch")
    from qwen_trt.fast import compile_cache
    from qwen_trt.fast.step import batched
    from qwen_trt.fast.model.config import FastConfig
    from qwen_trt.fast.model.model import Qwen3Fast

    cfg = FastConfig(vocab_size=64, hidden=32, intermediate=64, layers=1, heads=2, kv_heads=1,
                     head_dim=16, rope_theta=1e4, rms_eps=1e-6, tie_embeddings=True,
                     max_position_embeddings=4096)
    bm = batched.BatchedModel(Qwen3Fast(cfg, 2048, torch.float32, "cpu"), num_blocks=200,
                              block_size=16)
    monkeypatch.setattr(compile_cache, "_ACTIVE", cache)
    return bm, batched


def test_a_warm_start_captures_only_the_cached_projection_kernel(tmp_path, monkeypatch):
    cache = CompileCache(tmp_path, KEY, print).open(set_env=False)
    bm, batched = _cpu_batched(monkeypatch, cache)
    captured: list[tuple[int, str]] = []
    monkeypatch.setattr(bm, "_impls", lambda b: ("bgemm", "torch"))
    monkeypatch.setattr(bm, "_capture", lambda b, impl, feedback=False, width=None:
                        captured.append((b, impl)) or _FakeGraph(impl))
    monkeypatch.setattr(batched, "replay_ms", lambda g, n, warmup=1:
                        1.0 if g.impl == "torch" else 2.0)
    assert bm._graph(8).impl == "torch"               # cold: both captured and timed
    assert captured == [(8, "bgemm"), (8, "torch")]
    assert cache.picks["bucket_impl"] == {"8": "torch"}
    bm2, _ = _cpu_batched(monkeypatch, cache)
    monkeypatch.setattr(bm2, "_impls", lambda b: ("bgemm", "torch"))
    monkeypatch.setattr(bm2, "_capture", lambda b, impl, feedback=False, width=None:
                        captured.append((b, impl)) or _FakeGraph(impl))
    captured.clear()
    assert bm2._graph(8).impl == "torch"              # warm: the cached choice alone
    assert captured == [(8, "torch")] and bm2.stats.bucket_impl[8] == "torch"


def test_a_warm_start_skips_the_varlen_tile_timing(tmp_path, monkeypatch):
    cache = CompileCache(tmp_path, KEY, print).open(set_env=False)
    bm, batched = _cpu_batched(monkeypatch, cache)
    wanted = {n: [32, 8] for n in batched.STEP_TOKEN_BUCKETS}
    cache.picks["varlen_tile"] = {str(n): v for n, v in wanted.items()}

    def never(*a, **kw):
        raise AssertionError("a cached tile was timed again")
    monkeypatch.setattr(batched, "paged_varlen_attention", never)
    bm._pick_varlen_tile()
    need = {n: -(-(n + 1536) // 16) for n in batched.STEP_TOKEN_BUCKETS}
    fits = [n for n, k in need.items() if k < 200 and k <= bm.max_blocks]
    assert fits and bm.varlen_tile == {n: (32, 8) for n in fits}


def test_the_key_covers_every_fast_module_with_triton_kernels():
    """A warm start skips the self-checks its key recorded passing, so every fast-path module
    that defines Triton kernels must be in the kernel-source hash."""
    from pathlib import Path

    from qwen_trt.fast import compile_cache

    fast = Path(compile_cache.__file__).parent
    with_kernels = {p.relative_to(fast).as_posix() for p in fast.rglob("*.py")
                    if "@triton.jit" in p.read_text()}
    assert with_kernels and with_kernels <= set(compile_cache.KERNEL_SOURCES), (
        with_kernels - set(compile_cache.KERNEL_SOURCES))
    missing = [n for n in compile_cache.KERNEL_SOURCES if not (fast / n).is_file()]
    assert not missing, f"moved or renamed: {missing} (they would drop out of the key)"


def _warm_folder(root, key=KEY):
    c = CompileCache(root, key, print).open(set_env=False)
    t = Tuner()
    t.cache[(2560, 9728, 16, "torch.bfloat16")] = t.configs[2]
    c.remember("bucket_impl", 8, "bgemm")
    c.save_choices({"bgemm": t})
    c.seal()
    return c


def test_a_new_folder_starts_from_a_matching_seed_and_only_then(tmp_path):
    """A seed (a warm folder's choices measured on a GPU) fills a new folder's tuners and
    warm-up picks when its GPU, Triton minor, dtype, shapes, format and buckets match, and per
    tuner only when its configuration list is the same; a folder's own choices come first."""
    import subprocess
    import sys

    from qwen_trt.fast.compile_cache import find_seed, make_seed

    warm = _warm_folder(tmp_path / "measured")
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    seed = make_seed(warm.folder, {"bgemm": Tuner()}, "test machine")
    (seeds / "h200.json").write_text(json.dumps(seed))
    # another driver / torch / kernel hash and a patch release of Triton: still the seed's
    other = replace(KEY, driver="13010", torch="2.11.1", kernels="f" * 16, triton="3.6.1")
    fresh = CompileCache(tmp_path / "machine2", other, print).open(set_env=False)
    t = Tuner()
    assert fresh.load_choices({"bgemm": t}, seeds_dir=seeds) == 2
    assert fresh.seeded == "h200.json" and not fresh.warm
    assert t.cache[(2560, 9728, 16, "torch.bfloat16")] is t.configs[2]
    assert fresh.pick("bucket_impl", 8, ("bgemm", "torch")) == "bgemm"
    # another GPU, other shapes: no seed
    for field, value in (("gpu", "NVIDIA H100"), ("shapes", '{"hidden": 4096}'),
                         ("triton", "3.7.0"), ("buckets", "max_batch=8")):
        assert find_seed(replace(KEY, **{field: value}), seeds) is None, field
    # a tuner whose configuration list changed keeps nothing of the seed's rows (picks stay)
    changed = Tuner()
    changed.configs.append(Config(128, 8))
    c3 = CompileCache(tmp_path / "machine3", other, print).open(set_env=False)
    assert c3.load_choices({"bgemm": changed}, seeds_dir=seeds) == 1 and not changed.cache
    # the folder's own choices, once it has them, are not the seed's
    own = _warm_folder(tmp_path / "machine2", other)
    t4 = Tuner()
    assert own.load_choices({"bgemm": t4}, seeds_dir=seeds) == 2 and own.seeded == ""
    # the script writes the same seed from the folder
    out = tmp_path / "seed.json"
    r = subprocess.run([sys.executable, "scripts/tune_seed.py", str(warm.folder), str(out),
                        "--source", "test machine"], capture_output=True, text=True,
                       cwd=__import__("pathlib").Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["match"] == seed["match"]


def test_each_weight_format_has_its_own_key():
    """A --quantization fp8 / int4 load (or an FP8 / AWQ checkpoint) must not take a bf16
    start's self-check passes or tuned choices: the resolved format is in the key."""
    from qwen_trt.fast.compile_cache import format_key
    from qwen_trt.fast.model.qformats import QuantSpec

    keys = {format_key(QuantSpec(m)) for m in ("none", "fp8", "int4")}
    assert len(keys) == 3 and format_key(QuantSpec()) == KEY.weight_format
    assert format_key(QuantSpec("int4", group=64)) != format_key(QuantSpec("int4"))
    digests = {replace(KEY, weight_format=k).digest() for k in keys}
    assert len(digests) == 3


def test_the_fast_backend_keys_its_cache_with_the_resolved_format(tiny_model_dir, monkeypatch):
    from qwen_trt.backends.fast_backend import FastBackend
    from qwen_trt.fast import compile_cache

    seen = []

    class Stop(Exception):
        pass

    def fake_open(*a, **kw):
        seen.append(kw["weight_format"])
        raise Stop

    monkeypatch.setattr(compile_cache, "open_for_fast_path", fake_open)
    for q in ("auto", "fp8", "int4"):
        try:
            FastBackend.load(str(tiny_model_dir), device="cpu", quantization=q, warmup=False)
        except Stop:
            pass
    assert seen == ["bf16-safetensors", "fp8-block=128x128", "int4-group=128"]


def test_the_shipped_h200_seed_matches_a_default_serve_of_the_real_model():
    """The H200 seed (measured 2026-12-01 on the Qwen3-4B-shaped checkpoint) is found for
    `qwen-trt serve --max-batch 32` of Qwen3-4B-Instruct-2507 in bf16 on an H200 with Triton
    3.6: a change of the key's fields (shapes, buckets, format) that would leave it unused
    fails here, not silently on a user's first start."""
    from dataclasses import asdict

    from qwen_trt.backends.torch_backend import DEFAULT_MAX_SEQ_LEN
    from qwen_trt.fast import SHAPES
    from qwen_trt.fast.compile_cache import buckets_key, find_seed, format_key
    from qwen_trt.fast.model.qformats import QuantSpec

    key = replace(KEY, triton="3.6.0", dtype="bfloat16",
                  shapes=json.dumps(asdict(SHAPES["qwen3-4b"]), sort_keys=True, default=str),
                  weight_format=format_key(QuantSpec()),
                  buckets=buckets_key(for_runner=True, max_batch=32,
                                      max_seq_len=min(262144, DEFAULT_MAX_SEQ_LEN)))
    found = find_seed(key)
    assert found is not None
    path, seed = found
    assert path.name.startswith("h200-") and seed["choices"].get("bgemm")
    assert find_seed(replace(key, weight_format=format_key(QuantSpec("fp8")))) is None

