"""Issue 24 (cold start): what the engine process imports before it is ready, the load's
stage breakdown in its ready line, the API process's start order, and the kernel self-checks
a warm compile cache lets a start skip (and when it must not)."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap

import pytest

from qwen_trt.fast import compile_cache
from qwen_trt.fast.compile_cache import CacheKey, CompileCache, close_after_warmup, run_check
from qwen_trt.fast.options import KernelOptions, use

# Modules the engine has no use for before it serves: the HTTP stack, metrics, the grammar
# library (built on the first constrained request).
HEAVY_FOR_THE_ENGINE = ("fastapi", "starlette", "uvicorn", "prometheus_client", "xgrammar",
                        "qwen_trt.api")

# The worker's own main, in a fresh interpreter, over a fake pipe that prints what was
# imported (and the timings) when the worker says it is ready, then ends the worker.
_WORKER = textwrap.dedent("""
    import json, sys
    from qwen_trt.backends import BackendConfig
    from qwen_trt.serving.worker import WorkerSpec, worker_main

    class Conn:
        def send(self, msg):
            if msg[0] == "load_error":
                print(json.dumps({"error": msg[1]}), flush=True)
            if msg[0] == "ready":
                print(json.dumps({"modules": sorted(sys.modules),
                                  "timings": msg[1].timings}), flush=True)
        def recv(self):
            raise EOFError
        def poll(self, *a):
            return False

    cfg = BackendConfig(model=sys.argv[1], device="cpu", fast="on", max_batch=4, watchdog_s=0)
    worker_main(Conn(), WorkerSpec(cfg), parent_pid=__import__("os").getppid())
""")


@pytest.fixture(scope="module")
def worker_ready(tiny_model_dir):
    r = subprocess.run([sys.executable, "-c", _WORKER, str(tiny_model_dir)],
                       capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, r.stderr[-2000:]
    out = json.loads(lines[-1])
    assert "error" not in out, out
    return out


def test_the_engine_imports_nothing_heavy_before_it_is_ready(worker_ready):
    mods = worker_ready["modules"]
    loaded = sorted({h for h in HEAVY_FOR_THE_ENGINE for m in mods
                     if m == h or m.startswith(h + ".")})
    assert not loaded, f"the engine process imported {loaded} before it was ready"
    assert "torch" in mods                 # (the check sees what was imported)


def test_the_ready_timings_break_the_load_down(worker_ready):
    t = worker_ready["timings"]
    parts = {"load.resolve_s", "load.cuda_init_s", "load.fast_import_s", "load.cache_open_s",
             "load.weights_s", "load.tokenizer_wait_s", "load.tokenizer_thread_s"}
    assert parts <= set(t), sorted(set(t))
    assert {"import_s", "load_and_warmup_s", "runner_s", "total_s"} <= set(t)
    serial = sum(v for k, v in t.items() if k.startswith("load.")
                 and k != "load.tokenizer_thread_s")     # that one runs beside the others
    assert serial <= t["load_and_warmup_s"] + 0.05


def test_the_client_echoes_the_breakdown_in_its_ready_line(tiny_model_dir):
    from qwen_trt.backends import BackendConfig
    from qwen_trt.serving.client import WorkerClient
    from qwen_trt.serving.worker import WorkerSpec

    echo = io.StringIO()
    client = WorkerClient(WorkerSpec(BackendConfig(model=str(tiny_model_dir), device="cpu",
                                                   fast="on", max_batch=2, watchdog_s=0)),
                          echo=echo, wait=False, tokenizer_hint=str(tiny_model_dir))
    try:
        assert client.wait_ready() is client
        ready = [ln for ln in echo.getvalue().splitlines() if " ready in " in ln]
        assert ready and "load.weights_s" in ready[0] and "parent_tokenizer_s" in ready[0]
        assert client.tokenizer is not None
        assert client._preload.take(str(tiny_model_dir)) is client.tokenizer   # preloaded
    finally:
        client.close()


def test_serve_starts_the_engine_before_importing_the_http_server(monkeypatch):
    """``qwen-trt serve``: the engine process is started, then FastAPI is imported (while it
    loads), then the server binds at once (it waits for the engine itself, answering /health
    with 503 meanwhile: tests/test_replica_heals.py)."""
    code = textwrap.dedent("""
        import sys
        import qwen_trt.serving.service as service
        order = []
        class Fake:
            info = type("I", (), {"describe": lambda self: "fake"})()
            def wait_ready(self):
                order.append("wait_ready")
            def close(self):
                pass
        def start_service(cfg, wait=True, **kw):
            order.append(("start", wait, "fastapi" in sys.modules))
            return Fake()
        service.start_service = start_service
        import qwen_trt.api.server as server
        def run_server(*a, **k):
            order.append("run_server")
        server.run_server = run_server
        from qwen_trt.cli import main
        main(["serve", "--model", "x/y", "--port", "0"])
        print(order)
    """)
    # the server module is imported by the harness itself here, so the order is what counts
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert "[('start', False," in r.stdout, r.stdout + r.stderr[-2000:]
    assert r.stdout.strip().endswith("False, True), 'run_server']"), r.stdout   # no wait first


def test_serve_settings_are_checked_without_fastapi():
    code = ("import sys; from qwen_trt.cli import build_parser; "
            "from qwen_trt.commands.serve import settings_from; "
            "a = build_parser().parse_args(['serve']); settings_from(a, {}); "
            "print([m for m in sys.modules if m.startswith(('fastapi', 'qwen_trt.api.server'))"
            " and m != 'qwen_trt.api.server_settings'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]


# -- the self-checks and the compile cache -----------------------------------------------------
def _key(**kw) -> CacheKey:
    base = dict(gpu="H200", capability="9.0", driver="1", torch="2", triton="3", dtype="bf16",
                shapes="{}", weight_format="bf16", buckets="b", kernels="k")
    return CacheKey(**{**base, **kw})


def _weights(tmp_path, name="w", data=b"x"):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "model.safetensors").write_bytes(data)
    return d


def _open(root, weights, monkeypatch, key=None, say=None) -> CompileCache:
    c = CompileCache(root, key or _key(), say or (lambda s: None))
    c.weights_id = compile_cache.weights_id(weights)
    c.open(set_env=False)
    monkeypatch.setattr(compile_cache, "_ACTIVE", c)
    return c


def _start(root, weights, monkeypatch, ran, key=None, problem=None, say=None) -> CompileCache:
    """One start: open the cache, run the check 'attention', seal."""
    c = _open(root, weights, monkeypatch, key, say)
    run_check("attention", lambda: ran.append(1) or problem)
    c.seal()
    return c


def test_a_warm_cache_skips_a_check_that_passed_and_says_so(tmp_path, monkeypatch):
    w, ran = _weights(tmp_path), []
    _start(tmp_path / "c", w, monkeypatch, ran)            # cold: runs, records the pass
    assert ran == [1]
    lines = []
    c = _start(tmp_path / "c", w, monkeypatch, ran, say=lines.append)
    assert ran == [1] and c.warm and c.skipped == ["attention"]   # warm: skipped
    close_after_warmup(c, say=lines.append)
    assert any("self-checks skipped (attention)" in ln and "QWEN_TRT_SELF_CHECKS=always" in ln
               for ln in lines), lines


def test_cold_stale_forced_failed_or_other_weights_run_the_check(tmp_path, monkeypatch):
    w, ran = _weights(tmp_path), []
    root = tmp_path / "c"
    _start(root, w, monkeypatch, ran)
    assert ran == [1]                                      # cold
    _start(root, w, monkeypatch, ran, key=_key(driver="2"))
    assert len(ran) == 2                                   # another key: a cold folder
    with use(KernelOptions(self_checks="always")):
        c = _start(root, w, monkeypatch, ran)
    assert len(ran) == 3 and not c.skipped                 # forced
    other = _weights(tmp_path, "w2", b"yy")
    _start(root, other, monkeypatch, ran)
    assert len(ran) == 4                                   # other weights
    k3 = _key(driver="3")
    _start(root, other, monkeypatch, ran, key=k3, problem="differs")   # fails: recorded
    _start(root, other, monkeypatch, ran, key=k3)
    assert len(ran) == 6                                   # a failure is never skipped
    # a folder whose key no longer matches is rebuilt: its record goes with it
    (root / _key().digest() / "key.json").write_text("{}")
    c = _start(root, w, monkeypatch, ran)
    assert len(ran) == 7 and not c.skipped


def test_without_a_cache_or_weights_every_check_runs(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(compile_cache, "_ACTIVE", None)
    assert run_check("attention", lambda: ran.append(1)) is None and ran == [1]
    c = CompileCache(tmp_path / "c", _key(), lambda s: None).open(set_env=False)
    monkeypatch.setattr(compile_cache, "_ACTIVE", c)      # weights unknown ("")
    run_check("attention", lambda: ran.append(1))
    c.seal()
    c2 = _open(tmp_path / "c", tmp_path / "none", monkeypatch)
    run_check("attention", lambda: ran.append(1))
    assert len(ran) == 3 and not c2.skipped


def test_the_setting_is_declared_and_checked_once():
    from qwen_trt import settings

    assert KernelOptions.from_env({"QWEN_TRT_SELF_CHECKS": "always"}).self_checks == "always"
    assert KernelOptions.from_env({}).self_checks == "auto"
    with pytest.raises(settings.SettingError, match="QWEN_TRT_SELF_CHECKS"):
        KernelOptions.from_env({"QWEN_TRT_SELF_CHECKS": "never"})


def test_the_fast_backend_loads_its_hf_tokenizer_on_first_use_with_the_same_stop_ids(
        tiny_model_dir):
    """FastBackend.load reads tokenizer.json in Rust for the checks and the stop ids; the
    transformers tokenizer (seconds of GIL on the real vocabulary) loads after the rest in
    process, and on first use in the engine process (``for_runner``)."""
    from qwen_trt.backends.fast_backend import FastBackend
    from qwen_trt.model.source import load_tokenizer
    from qwen_trt.model.template import default_stop_ids

    eager = FastBackend.load(str(tiny_model_dir), device="cpu", warmup=False)
    try:                                    # in process: loaded with the rest
        assert eager._tokenizer is not None and "hf_tokenizer_s" in eager.load_stages
    finally:
        eager.close()
    backend = FastBackend.load(str(tiny_model_dir), device="cpu", warmup=False, for_runner=True)
    try:
        assert backend._tokenizer is None
        want = default_stop_ids(load_tokenizer(tiny_model_dir))
        assert backend.info.stop_token_ids == want and want
        assert backend.tokenizer_source == str(tiny_model_dir)
        tok = backend.tokenizer
        assert tok is backend.tokenizer and backend._tokenizer is tok
    finally:
        backend.close()


def test_stop_ids_from_files_need_the_eos_in_the_vocabulary(tiny_model_dir, tmp_path):
    import json
    import shutil

    from tokenizers import Tokenizer

    from qwen_trt.model.template import stop_ids_from_files

    parsed = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert stop_ids_from_files(parsed, tiny_model_dir)
    assert stop_ids_from_files(None, tiny_model_dir) is None
    odd = tmp_path / "odd"
    shutil.copytree(tiny_model_dir, odd)
    cfg = json.loads((odd / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|not-in-the-vocab|>"}
    (odd / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert stop_ids_from_files(parsed, odd) is None      # then the loaded tokenizer decides
