"""The trtllm backend's LLM API path by contract: the checkpoint through ``tensorrt_llm.LLM``
(PyTorch backend) on the fake 1.3.0 install (no engine builder) and on the fake 1.2.1 one.

The fake LLM follows upstream's signatures and errors (tests/fake_trtllm/llmapi_impl.py): its
results stream only on an asyncio loop that was running when ``generate_async`` was called, an
unknown ``LLM`` or ``SamplingParams`` keyword is refused, ``abort()`` ends a request with
'cancelled', an executor error is raised from the iteration.
"""
from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_trtllm.support import calls, fake_trtllm, fake_trtllm_13, set_gpu  # noqa: E402,F401

from qwen_trt.backends.trtllm import load_trtllm  # noqa: E402
from qwen_trt.backends.trtllm_backend import TrtllmRuntimeError  # noqa: E402
from qwen_trt.backends.trtllm_llmapi import (DEFAULT_LIMITS, LlmApiBackend,  # noqa: E402
                                             llmapi_sampling_kwargs)
from qwen_trt.serving.generation import ReplyStream  # noqa: E402
from qwen_trt.model.template import ENDOFTEXT, IM_END  # noqa: E402
from qwen_trt.params import SamplingParams  # noqa: E402


@pytest.fixture
def llmapi(fake_trtllm_13, monkeypatch, tiny_model_dir, tmp_path):
    set_gpu(monkeypatch, "a10")
    monkeypatch.setenv("QWEN_TRT_ENGINES_DIR", str(tmp_path / "no-engines"))
    b = load_trtllm(model=str(tiny_model_dir), warmup=False)
    b.stall_timeout_s = 10.0
    yield b
    b.close()


def _engine(backend):
    return backend.llm.executor


def _cls():
    from fake_trtllm.llmapi_impl import FakePyExecutor

    return FakePyExecutor


def _prompt(backend):
    return backend.tokenizer.encode("Hello, how are you today?", add_special_tokens=False)


def _special(backend):
    return backend.tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])


def _sent(trt):
    return [c["sampling_params"] for c in calls(trt, "generate_async.enqueued")]


# ---------------------------------------------------------------- load and info

def test_a_checkpoint_without_engine_takes_the_llm_api_path(llmapi, fake_trtllm_13,
                                                            tiny_model_dir):
    assert isinstance(llmapi, LlmApiBackend)
    (args,) = calls(fake_trtllm_13, "LLM")
    assert args["model"] == str(tiny_model_dir)
    kv = args["kv_cache_config"]
    assert kv.enable_block_reuse is True and kv.free_gpu_memory_fraction == 0.85   # a10.toml
    assert (args["max_batch_size"], args["max_seq_len"], args["max_num_tokens"]) == (8, 16384, 8192)
    assert args["enable_chunked_prefill"] is True
    info = llmapi.info
    assert info.name == "trtllm" and info.path == "llmapi" and info.max_concurrency == 8
    assert info.max_seq_len == 16384 and info.device == "NVIDIA A10"
    assert "trtllm (LLM API, PyTorch backend)" in info.describe()
    assert llmapi.make_runner().stats().extra["path"] == "llmapi"


def test_a_gpu_without_profile_gets_the_default_limits(fake_trtllm_13, monkeypatch,
                                                       tiny_model_dir, tmp_path):
    from qwen_trt.engine import gpu as gpu_mod

    monkeypatch.setattr(gpu_mod, "detect_gpu",
                        lambda index=0: gpu_mod.GpuInfo("NVIDIA B200", (10, 0), 179.0))
    b = load_trtllm(model=str(tiny_model_dir), warmup=False, max_seq_len=4096)
    try:
        (args,) = calls(fake_trtllm_13, "LLM")
        assert args["max_batch_size"] == DEFAULT_LIMITS.max_batch_size
        assert args["max_seq_len"] == 4096 == b.info.max_seq_len
    finally:
        b.close()


# ---------------------------------------------------------------- requests

@pytest.mark.parametrize("chunks", [[1], [3], [2, 5, 1]])
def test_stream_yields_each_new_token_once(llmapi, monkeypatch, chunks):
    script = [30, 31, 32, 33, 34, 35, 36, 37]
    monkeypatch.setattr(_cls(), "script", script)
    monkeypatch.setattr(_cls(), "chunks", chunks)
    toks = list(llmapi.stream(_prompt(llmapi), SamplingParams(max_new_tokens=6, temperature=0)))
    assert toks == script[:6]


def test_the_request_the_llm_gets(llmapi, fake_trtllm_13):
    im_end, eot = _special(llmapi)
    prompt = _prompt(llmapi)
    list(llmapi.stream(prompt, SamplingParams(max_new_tokens=4, temperature=0.6, top_p=0.9,
                                               top_k=30, seed=7, presence_penalty=0.5,
                                               repetition_penalty=1.1)))
    (enq,) = calls(fake_trtllm_13, "generate_async.enqueued")
    assert enq["prompt_token_ids"] == prompt and enq["streaming"] is True
    sp = enq["sampling_params"]
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (4, 0.6, 0.9, 30, 7)
    assert (sp.presence_penalty, sp.repetition_penalty) == (0.5, 1.1)
    assert sp.end_id == im_end and sp.stop_token_ids == [im_end, eot]
    assert sp.include_stop_str_in_output is True and sp.detokenize is False
    list(llmapi.stream(prompt, SamplingParams(max_new_tokens=2, temperature=0)))
    g = _sent(fake_trtllm_13)[1]
    assert (g.top_k, g.top_p, g.temperature) == (1, None, None)          # greedy
    list(llmapi.stream(prompt, SamplingParams(max_new_tokens=2, top_k=0)))
    assert _sent(fake_trtllm_13)[2].top_k is None                        # 0 = no top-k filter


def test_sampling_kwargs_are_accepted_by_upstreams_sampling_params(fake_trtllm_13):
    from tensorrt_llm import SamplingParams as Upstream

    for p in (SamplingParams(), SamplingParams(temperature=0), SamplingParams(ignore_eos=True),
              SamplingParams(seed=3, presence_penalty=-1.0, repetition_penalty=0.9, top_k=0)):
        kw = llmapi_sampling_kwargs(p, end_id=5, stop_words=(5, 6))
        sp = Upstream(**kw)                   # kw_only dataclass: a wrong name is a TypeError
        assert sp.max_tokens == p.max_new_tokens
        assert sp.ignore_eos == p.ignore_eos
        assert (sp.stop_token_ids is None) == p.ignore_eos


@pytest.mark.parametrize("include_end_id", [True, False])
def test_stop_on_im_end_reports_stop(llmapi, monkeypatch, include_end_id):
    im_end, _ = _special(llmapi)
    monkeypatch.setattr(_cls(), "script", [30, 31, im_end, 40, 41])
    monkeypatch.setattr(_cls(), "include_end_id", include_end_id)
    rs = ReplyStream(llmapi, _prompt(llmapi), SamplingParams(max_new_tokens=10, temperature=0))
    text = "".join(rs)
    assert rs.reply.metrics.finish_reason == "stop" and rs.reply.metrics.tokens == 3
    assert rs.reply.token_ids == [30, 31] and text == llmapi.tokenizer.decode([30, 31])


def test_endoftext_stop_word_ends_the_reply(llmapi, monkeypatch):
    _, eot = _special(llmapi)
    monkeypatch.setattr(_cls(), "script", [30, eot, 40, 41])
    assert list(llmapi.stream(_prompt(llmapi), SamplingParams(max_new_tokens=10,
                                                               temperature=0))) == [30, eot]


def test_length_and_ignore_eos(llmapi, monkeypatch):
    im_end, _ = _special(llmapi)
    monkeypatch.setattr(_cls(), "script", [30, im_end, 32, 33, 34])
    toks = list(llmapi.stream(_prompt(llmapi), SamplingParams(max_new_tokens=4, temperature=0,
                                                               ignore_eos=True)))
    assert toks == [30, im_end, 32, 33]


def test_closing_the_generator_aborts_and_the_next_request_runs(llmapi, monkeypatch,
                                                                fake_trtllm_13):
    monkeypatch.setattr(_cls(), "script", list(range(30, 60)))
    gen = llmapi.stream(_prompt(llmapi), SamplingParams(max_new_tokens=20, temperature=0))
    assert [next(gen), next(gen)] == [30, 31]
    gen.close()
    (enq,) = calls(fake_trtllm_13, "generate_async.enqueued")
    for _ in range(200):                       # the abort runs on the LLM API's loop thread
        if calls(fake_trtllm_13, "abort_request"):
            break
        threading.Event().wait(0.01)
    assert calls(fake_trtllm_13, "abort_request") == [{"id": enq["id"]}]
    assert list(llmapi.stream(_prompt(llmapi), SamplingParams(max_new_tokens=3,
                                                              temperature=0))) == [30, 31, 32]


def test_an_executor_error_is_one_line_and_fails_only_its_request(llmapi, monkeypatch):
    monkeypatch.setattr(_cls(), "script_for", staticmethod(
        lambda p: [100 + 10 * (p[-1] % 10) + i for i in range(6)]))
    monkeypatch.setattr(_cls(), "fail_for", staticmethod(
        lambda p, sp: "Encountered an error in forward: CUDA out of memory\n  at ..."
        if p == [2] else None))
    runner = llmapi.make_runner()
    for i in (1, 2, 3):
        runner.add(i, [i], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    got, finish = _drive(runner)
    assert finish[2] == ("error", "TensorRT-LLM request failed: Encountered an error in "
                                  "forward: CUDA out of memory")
    assert got[1] == [110 + i for i in range(6)] and got[3] == [130 + i for i in range(6)]
    with pytest.raises(TrtllmRuntimeError, match="^TensorRT-LLM request failed: Encountered"):
        list(llmapi.stream([2], SamplingParams(max_new_tokens=3)))


def test_a_request_the_llm_refuses_is_one_line(llmapi):
    llmapi.llm.shutdown()
    runner = llmapi.make_runner()
    runner.add(1, [5, 6], SamplingParams(max_new_tokens=2))
    (ev,) = runner.step()
    assert ev.finish == "error" and ev.error == ("TensorRT-LLM rejected the request: LLM is "
                                                 "shutting down")


# ---------------------------------------------------------------- many requests: the Runner

def _drive(runner, limit=3000):
    got: dict[int, list[int]] = {}
    finish: dict[int, tuple] = {}
    for _ in range(limit):
        if not runner.has_work():
            break
        for ev in runner.step():
            assert ev.request_id not in finish, "event after the final one"
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finish:
                finish[ev.request_id] = (ev.finish, ev.error)
    else:
        raise AssertionError("runner never finished")
    return got, finish


def test_in_flight_batching_routes_each_request(llmapi, monkeypatch):
    monkeypatch.setattr(_cls(), "script_for", staticmethod(
        lambda p: [100 + 10 * (p[-1] % 10) + i for i in range(8)]))
    ex = _engine(llmapi)
    ex.budget = 0                               # hold the engine until all four are in
    runner = llmapi.make_runner()
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    for i in range(1, 5):
        runner.add(i, [50 + i, i], params)
    assert runner.stats().running == 4
    ex.allow(1000)
    got, finish = _drive(runner)
    assert got == {i: [100 + 10 * i + k for k in range(8)] for i in range(1, 5)}
    assert finish == {i: ("length", None) for i in range(1, 5)}
    assert ex.max_in_flight == 4                # one batch, not one request after another


def test_abort_one_request_keeps_the_others(llmapi, monkeypatch, fake_trtllm_13):
    monkeypatch.setattr(_cls(), "script_for", staticmethod(
        lambda p: [100 + 10 * (p[-1] % 10) + i for i in range(12)]))
    ex = _engine(llmapi)
    ex.budget = 0
    runner = llmapi.make_runner()
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    for i in (1, 2, 3):
        runner.add(i, [i], params)
    ids = {c["prompt_token_ids"][0]: c["id"] for c in calls(fake_trtllm_13,
                                                            "generate_async.enqueued")}
    ex.allow(3)
    seen: dict[int, list[int]] = {}
    for _ in range(2000):
        for ev in runner.step():
            assert ev.finish is None
            seen.setdefault(ev.request_id, []).extend(ev.token_ids)
        if all(len(seen.get(i, [])) == 3 for i in (1, 2, 3)):
            break
    runner.abort(2)
    ex.allow(100)
    got, finish = _drive(runner)
    assert finish[2] == ("cancelled", None) and got[2] == []
    for i in (1, 3):
        assert seen[i] + got[i] == [100 + 10 * i + k for k in range(12)]
    assert calls(fake_trtllm_13, "abort_request") == [{"id": ids[2]}]


# ---------------------------------------------------------------- which path, which release

def test_engine_folder_on_a_release_without_engines_is_one_line(fake_trtllm_13, monkeypatch,
                                                                 tmp_path):
    from qwen_trt.engine.env import NoEngineBuilderError

    set_gpu(monkeypatch, "a10")
    with pytest.raises(NoEngineBuilderError) as e:
        load_trtllm(engine=str(tmp_path), warmup=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("tensorrt_llm 1.3.0 builds and runs no TensorRT "
                                              "engines (the TensorRT backend was removed after "
                                              "1.3.0rc20)")
    assert "--backend trtllm --model <checkpoint>" in msg and '.[trtllm]' in msg
    assert calls(fake_trtllm_13, "LLM") == []


def test_no_engine_on_1_2_takes_the_llm_api_path(fake_trtllm, monkeypatch, tiny_model_dir,
                                                 tmp_path):
    set_gpu(monkeypatch, "l4")
    monkeypatch.setenv("QWEN_TRT_ENGINES_DIR", str(tmp_path / "none"))
    b = load_trtllm(model=str(tiny_model_dir), warmup=False)
    try:
        assert b.info.path == "llmapi" and calls(fake_trtllm, "LLM")
        assert calls(fake_trtllm, "ModelRunnerCpp.from_dir") == []
        assert b.info.max_concurrency == 4                     # the l4 profile's batch
    finally:
        b.close()


def test_release_gates():
    from qwen_trt.engine.env import has_engine_backend, has_llm_api, release_key

    assert [has_engine_backend(v) for v in ("1.1.0", "1.2.0", "1.2.1", "1.3.0rc1",
                                            "1.3.0rc20", "1.3.0rc21", "1.3.0", "1.4.0rc4")] == \
        [False, True, True, True, True, False, False, False]
    assert [has_llm_api(v) for v in ("1.1.0", "1.2.0", "1.3.0", "2.0.0")] == \
        [False, True, True, True]
    assert release_key("1.3.0rc20") < release_key("1.3.0rc21") < release_key("1.3.0")


def test_build_on_a_release_without_engines_is_one_line(fake_trtllm_13, monkeypatch,
                                                        tiny_model_dir, tmp_path, capsys):
    from qwen_trt.cli import main

    set_gpu(monkeypatch, "a10")
    rc = main(["build", "--gpu", "a10", "--model", str(tiny_model_dir),
               "--out-dir", str(tmp_path / "out"), "--engines-dir", str(tmp_path / "engines")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1, err
    assert "tensorrt_llm 1.3.0 builds and runs no TensorRT engines" in err
    assert "Traceback" not in err and not (tmp_path / "engines").exists()


# ---------------------------------------------------------------- the fake follows upstream

def test_the_fake_llm_refuses_what_upstream_refuses(fake_trtllm_13, tiny_model_dir):
    from tensorrt_llm import LLM, SamplingParams as Upstream
    from tensorrt_llm.llmapi import KvCacheConfig

    with pytest.raises(ValueError, match="specific to TensorRT backend"):
        LLM(model=str(tiny_model_dir), build_config=object())
    with pytest.raises(ValueError, match="got invalid argument: max_tokens_in_paged_kv_cache"):
        LLM(model=str(tiny_model_dir), max_tokens_in_paged_kv_cache=5)
    with pytest.raises(Exception, match="enable_block_reus"):
        KvCacheConfig(enable_block_reus=True)                  # strict model
    with pytest.raises(TypeError):
        Upstream(max_new_tokens=3)                             # kw_only, upstream's names
    llm = LLM(model=str(tiny_model_dir))
    try:
        result = llm.generate_async([1, 2], Upstream(max_tokens=2), streaming=True)

        async def consume():
            async for _ in result:
                pass

        with pytest.raises(AssertionError, match="event loop was not present"):
            asyncio.run(consume())                             # made outside a running loop
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- Qwen's FP8 checkpoint

def _fp8_copy(tiny_model_dir, tmp_path):
    import json
    import shutil

    dest = tmp_path / "tiny-fp8"
    shutil.copytree(tiny_model_dir, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_the_fp8_checkpoint_loads_on_hopper(fake_trtllm_13, monkeypatch, tiny_model_dir, tmp_path):
    set_gpu(monkeypatch, "h200")
    b = load_trtllm(model=str(_fp8_copy(tiny_model_dir, tmp_path)), warmup=False)
    try:
        assert b.info.path == "llmapi" and b.info.dtype == "fp8 (128x128 blocks)"
        assert b.info.max_concurrency == 32                       # the h200 profile
    finally:
        b.close()


def test_the_fp8_checkpoint_on_an_a10_is_one_line(fake_trtllm_13, monkeypatch, tiny_model_dir,
                                                  tmp_path):
    from qwen_trt.errors import BackendUnavailableError

    set_gpu(monkeypatch, "a10")
    with pytest.raises(BackendUnavailableError) as e:
        load_trtllm(model=str(_fp8_copy(tiny_model_dir, tmp_path)), warmup=False)
    msg = str(e.value)
    assert "is an FP8 checkpoint (fp8 (128x128 blocks)), which needs an sm89+ GPU" in msg
    assert "this GPU is A10 (sm86)" in msg and "QUANT=int4_awq" in msg and "\n" not in msg
    assert calls(fake_trtllm_13, "LLM") == []


# ---------------------------------------------------------------- through the service

def test_the_service_checks_pass_on_the_llm_api_path(llmapi, monkeypatch):
    from service_checks import (check_cancel_mid_reply_leaves_engine_clean,
                                check_threads_get_their_own_replies)

    from qwen_trt.serving.service import InferenceService

    vocab = len(llmapi.tokenizer) - 300      # ordinary tokens, no specials
    monkeypatch.setattr(_cls(), "script_for", staticmethod(
        lambda p: [(1000 + 37 * p[-1] + 11 * i) % vocab for i in range(4000)]))
    service = InferenceService(llmapi)
    try:
        tok = llmapi.tokenizer
        prompts = [tok.encode(t, add_special_tokens=False) for t in ("one", "two", "three")]
        check_threads_get_their_own_replies(service, prompts,
                                            SamplingParams(max_new_tokens=6, temperature=0), 30)
        check_cancel_mid_reply_leaves_engine_clean(
            service, prompts[0], SamplingParams(max_new_tokens=6, temperature=0), 30)
    finally:
        service.close()


def test_the_llm_api_path_on_a_release_too_old_is_one_line(fake_trtllm, monkeypatch,
                                                           tiny_model_dir, tmp_path):
    from qwen_trt.engine.env import TrtllmNotInstalledError

    set_gpu(monkeypatch, "a10")
    monkeypatch.setattr(fake_trtllm, "__version__", "1.1.0")
    with pytest.raises(TrtllmNotInstalledError) as e:
        load_trtllm(model=str(tiny_model_dir), warmup=False)
    msg = str(e.value)
    assert msg.startswith("tensorrt_llm 1.1.0 is installed, but the LLM API path needs "
                          "tensorrt_llm>=1.2") and '.[trtllm-llmapi]' in msg and "\n" not in msg
    assert calls(fake_trtllm, "LLM") == []
