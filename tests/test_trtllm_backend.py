"""The trtllm backend by contract: fake tensorrt_llm 1.2.1 executor, pretend GPU, tiny model.

The fake executor holds several requests at once and hands out responses of all of them,
interleaved, without filtering by request id unless asked (like the real one); see
tests/fake_trtllm/tensorrt_llm/bindings/executor.py.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_trtllm.support import FAKE_DIR, calls, fake_trtllm, set_gpu  # noqa: E402,F401

from qwen_trt.backends.trtllm_backend import (NO_END_ID, RequestStream, Routed,  # noqa: E402
                                              TrtllmRuntimeError,
                                              auto_engine_dir, final_stop_token,
                                              request_ids_for, runner_kwargs,
                                              sampling_config_kwargs)
from qwen_trt.backends.trtllm import load_trtllm  # noqa: E402
from qwen_trt.serving.generation import ReplyStream  # noqa: E402
from qwen_trt.model.template import ENDOFTEXT, IM_END  # noqa: E402
from qwen_trt.errors import EngineMismatchError, PromptTooLongError  # noqa: E402
from qwen_trt.params import SamplingParams  # noqa: E402


# ---------------------------------------------------------------- pure conversion

def test_final_stop_token():
    stops = (3, 4)
    assert final_stop_token([10, 11], 8, stops, end_id=3) == 3       # ended early, id hidden
    assert final_stop_token([10, 3], 8, stops, end_id=3) is None     # id shown already
    assert final_stop_token([10, 4], 8, stops, end_id=3) is None     # stop word shown
    assert final_stop_token([10] * 8, 8, stops, end_id=3) is None    # length
    assert final_stop_token([], 8, stops, end_id=3) == 3             # stopped at once
    assert final_stop_token([10], 8, (), end_id=NO_END_ID) is None   # ignore_eos


def test_request_ids_and_sampling_config():
    p = SamplingParams(stop_token_ids=(100, 101, 102))
    r = request_ids_for(p, im_end=101, pad_id=100)
    assert (r.end_id, r.pad_id, r.stop_words) == (101, 100, (101, 100, 102))
    r = request_ids_for(SamplingParams(ignore_eos=True, stop_token_ids=(101,)), 101, 100)
    assert r.end_id == NO_END_ID and r.stop_words == ()
    assert sampling_config_kwargs(SamplingParams(temperature=0)) == {
        "beam_width": 1, "temperature": 1.0, "top_k": 1}
    assert sampling_config_kwargs(SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=3)) == {
        "beam_width": 1, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "seed": 3}


def _rs(max_new=5, stops=(3, 4), end_id=3):
    params = SamplingParams(max_new_tokens=max_new, stop_token_ids=stops)
    return RequestStream(params, request_ids_for(params, end_id, 0), stops)


def test_request_stream_chunks_stop_length_and_errors():
    rs = _rs()
    assert rs.feed(Routed((10,))) == [10] and rs.feed(Routed(())) == []
    assert rs.feed(Routed((11, 4, 12))) == [11, 4] and rs.finish == "stop"   # stop mid-chunk
    assert rs.feed(Routed((13,), final=True)) == []                            # after the end
    rs = _rs(max_new=3)
    assert rs.feed(Routed((10, 11, 12, 13))) == [10, 11, 12] and rs.finish == "length"
    rs = _rs()
    assert rs.feed(Routed((10,), final=True)) == [10, 3] and rs.finish == "stop"  # end id hidden
    rs = _rs()
    assert rs.feed(Routed(final=True, error="CUDA error: an illegal memory access\nat ...")) == []
    assert rs.finish == "error"
    assert rs.error == "TensorRT-LLM request failed: CUDA error: an illegal memory access"


# ---------------------------------------------------------------- backend on the fake executor

@pytest.fixture(scope="module")
def built_engine(tiny_model_dir, tmp_path_factory):
    """One engine folder built by the real pipeline with the fake tensorrt_llm, per module."""
    from fake_trtllm.support import _purge

    from qwen_trt.engine.build import BuildRequest, run_build

    root = tmp_path_factory.mktemp("trt")
    with pytest.MonkeyPatch.context() as mp:
        _purge()
        mp.syspath_prepend(str(FAKE_DIR))
        set_gpu(mp, "a10")
        run_build(BuildRequest(gpu="a10", model=str(tiny_model_dir), out_dir=root / "out",
                               engines_dir=root / "engines"), write=lambda s: None)
    _purge()
    return root / "engines" / "a10"


@pytest.fixture
def engine_dir(built_engine, tmp_path):
    dest = tmp_path / "engines" / "a10"
    shutil.copytree(built_engine, dest)
    return dest


@pytest.fixture
def backend(fake_trtllm, monkeypatch, engine_dir):
    set_gpu(monkeypatch, "a10")
    b = load_trtllm(engine=str(engine_dir), warmup=False)
    b.stall_timeout_s = 10.0     # a routing bug fails the test instead of hanging it
    yield b
    b.close()


def _executor_cls():
    from tensorrt_llm.bindings.executor import Executor

    return Executor


def _executor(backend):
    return backend.runner.executor


def _special(backend):
    return backend.tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])


def _prompt(backend):
    return backend.tokenizer.encode("Hello, how are you today?", add_special_tokens=False)


def test_load_passes_manifest_limits_and_declares_the_concurrency(backend, fake_trtllm,
                                                                  engine_dir):
    (args,) = calls(fake_trtllm, "ModelRunnerCpp.from_dir")
    m = json.loads((engine_dir / "manifest.json").read_text())
    assert args["engine_dir"] == str(engine_dir)
    assert args["max_batch_size"] == m["limits"]["max_batch_size"]
    assert args["max_input_len"] == m["limits"]["max_input_len"]
    assert args["max_output_len"] is None       # runtime max_seq_len = the engine's
    assert args["kv_cache_free_gpu_memory_fraction"] == m["runtime"]["kv_cache_free_gpu_memory_fraction"]
    assert args["kv_cache_enable_block_reuse"] is True and args["enable_chunked_context"] is True
    info = backend.info
    assert info.name == "trtllm" and info.max_seq_len == m["limits"]["max_seq_len"]
    assert info.device == "NVIDIA A10" and info.dtype == "float16" == m["dtype"]
    assert info.max_concurrency == m["limits"]["max_batch_size"] == 8
    assert backend.make_runner().max_concurrency == 8
    # tokenizer comes from the engine folder's copy
    from transformers import AutoTokenizer

    copied = AutoTokenizer.from_pretrained(engine_dir / "tokenizer")
    assert backend.tokenizer.encode("hello world 你好") == copied.encode("hello world 你好")
    assert runner_kwargs(m)["rank"] == 0


@pytest.mark.parametrize("chunks", [[1], [3], [2, 5, 1]])
def test_stream_yields_each_new_token_once(backend, monkeypatch, chunks):
    script = [30, 31, 32, 33, 34, 35, 36, 37]
    monkeypatch.setattr(_executor_cls(), "script", script)
    monkeypatch.setattr(_executor_cls(), "chunks", chunks)
    toks = list(backend.stream(_prompt(backend), SamplingParams(max_new_tokens=6, temperature=0)))
    assert toks == script[:6]


def test_the_request_the_executor_gets(backend, fake_trtllm):
    im_end, eot = _special(backend)
    prompt = _prompt(backend)
    params = SamplingParams(max_new_tokens=4, temperature=0.6, top_p=0.9, top_k=30, seed=7,
                            stop_token_ids=(im_end, eot))
    list(backend.stream(prompt, params))
    (enq,) = calls(fake_trtllm, "enqueue_requests")
    (r,) = enq["requests"]
    assert r.input_token_ids == prompt and r.streaming and r.max_tokens == 4
    assert r.output_config.exclude_input_from_output
    assert (r.end_id, r.pad_id) == (im_end, eot)
    assert r.stop_words == [[im_end], [eot]]
    s = r.sampling_config
    assert (s.beam_width, s.temperature, s.top_k, s.top_p, s.seed) == (1, 0.6, 30, 0.9, 7)
    list(backend.stream(prompt, SamplingParams(max_new_tokens=2, temperature=0)))
    g = calls(fake_trtllm, "enqueue_requests")[1]["requests"][0].sampling_config
    assert (g.top_k, g.top_p, g.temperature) == (1, None, 1.0)          # greedy
    assert calls(fake_trtllm, "generate") == []    # never ModelRunnerCpp.generate's id-less loop


def test_the_dispatcher_never_waits_without_a_timeout(backend):
    list(backend.stream(_prompt(backend), SamplingParams(max_new_tokens=3, temperature=0)))
    timeouts = _executor(backend).timeouts
    assert timeouts and all(isinstance(t, timedelta) and t.total_seconds() <= 0.1
                            for t in timeouts)


@pytest.mark.parametrize("include_end_id", [True, False])
def test_stop_on_im_end_reports_stop(backend, monkeypatch, include_end_id):
    im_end, _ = _special(backend)
    monkeypatch.setattr(_executor_cls(), "script", [30, 31, im_end, 40, 41])
    monkeypatch.setattr(_executor_cls(), "include_end_id", include_end_id)
    rs = ReplyStream(backend, _prompt(backend), SamplingParams(max_new_tokens=10, temperature=0))
    text = "".join(rs)
    reply = rs.reply
    assert reply.metrics.finish_reason == "stop"
    assert reply.metrics.tokens == 3                       # two tokens + the stop token
    assert reply.token_ids == [30, 31]
    assert text == backend.tokenizer.decode([30, 31])


def test_endoftext_stop_word_ends_the_reply(backend, monkeypatch):
    _, eot = _special(backend)
    monkeypatch.setattr(_executor_cls(), "script", [30, eot, 40, 41])
    toks = list(backend.stream(_prompt(backend), SamplingParams(
        max_new_tokens=10, temperature=0, stop_token_ids=_special(backend))))
    assert toks == [30, eot]


def test_length_finish(backend, monkeypatch):
    monkeypatch.setattr(_executor_cls(), "script", list(range(30, 60)))
    rs = ReplyStream(backend, _prompt(backend), SamplingParams(max_new_tokens=3, temperature=0))
    list(rs)
    assert rs.reply.metrics.finish_reason == "length" and rs.reply.metrics.tokens == 3


def test_closing_the_generator_cancels_and_leaves_the_executor_clean(backend, monkeypatch,
                                                                     fake_trtllm):
    monkeypatch.setattr(_executor_cls(), "script", list(range(30, 60)))
    gen = backend.stream(_prompt(backend), SamplingParams(max_new_tokens=20, temperature=0))
    assert [next(gen), next(gen)] == [30, 31]
    gen.close()
    (enq,) = calls(fake_trtllm, "enqueue_requests")
    assert calls(fake_trtllm, "cancel_request") == [{"id": enq["ids"][0]}]
    assert list(backend.stream(_prompt(backend), SamplingParams(max_new_tokens=4,
                                                                temperature=0))) == [30, 31, 32, 33]


def test_late_final_response_of_a_cancelled_request_is_dropped(backend, monkeypatch):
    """The executor acknowledges the cancel only after the next request started."""
    monkeypatch.setattr(_executor_cls(), "script", list(range(30, 60)))
    monkeypatch.setattr(_executor_cls(), "late_cancel_ack", True)
    gen = backend.stream(_prompt(backend), SamplingParams(max_new_tokens=20, temperature=0))
    next(gen)
    gen.close()
    toks = list(backend.stream(_prompt(backend), SamplingParams(max_new_tokens=3, temperature=0)))
    assert toks == [30, 31, 32]
    ex = _executor(backend)
    assert ex.requests[1].final_sent and ex.requests[1].cancelled


def test_cancel_from_another_caller_stops_the_request(backend, monkeypatch, fake_trtllm):
    monkeypatch.setattr(_executor_cls(), "script", list(range(30, 60)))
    rs = ReplyStream(backend, _prompt(backend), SamplingParams(max_new_tokens=20, temperature=0))
    n = 0
    for _ in rs:
        n += 1
        if n == 2:
            rs.cancel()
    assert rs.reply.metrics.finish_reason == "cancelled"
    assert rs.reply.metrics.tokens < 20
    assert len(calls(fake_trtllm, "cancel_request")) == 1


def test_stop_token_then_close_does_not_cancel(backend, monkeypatch, fake_trtllm):
    im_end, _ = _special(backend)
    monkeypatch.setattr(_executor_cls(), "script", [30, im_end])
    rs = ReplyStream(backend, _prompt(backend), SamplingParams(max_new_tokens=10, temperature=0))
    list(rs)
    assert rs.reply.metrics.finish_reason == "stop"
    assert calls(fake_trtllm, "cancel_request") == []


def test_executor_error_says_its_message(backend, monkeypatch):
    monkeypatch.setattr(_executor_cls(), "error_after", 1)
    with pytest.raises(TrtllmRuntimeError) as e:
        list(backend.stream(_prompt(backend), SamplingParams(max_new_tokens=10, temperature=0)))
    msg = str(e.value)
    assert msg == ("TensorRT-LLM request failed: Encountered an error in forwardAsync function: "
                   "CUDA out of memory")
    assert "Cannot get the result" not in msg


def test_prompt_longer_than_the_engine_allows(backend):
    too_long = [30] * (backend.info.max_input_len + 1)
    with pytest.raises(PromptTooLongError, match="exceeds this backend's limits"):
        backend.check_request(too_long, SamplingParams(max_new_tokens=1))


def test_penalties_reach_the_sampling_config(backend, fake_trtllm):
    list(backend.stream(_prompt(backend), SamplingParams(
        max_new_tokens=2, temperature=0.7, presence_penalty=0.5, repetition_penalty=1.1)))
    s = calls(fake_trtllm, "enqueue_requests")[0]["requests"][0].sampling_config
    assert (s.presence_penalty, s.repetition_penalty) == (0.5, 1.1)


# ---------------------------------------------------------------- many requests: the Runner

def _distinct_scripts(monkeypatch, n_tokens=6):
    """Each request generates tokens derived from its prompt's last token, so a response routed
    to the wrong request shows."""
    monkeypatch.setattr(_executor_cls(), "script_for",
                        staticmethod(lambda p: [100 + 10 * (p[-1] % 10) + i
                                                for i in range(n_tokens)]))


def _drive(runner, limit=2000):
    got: dict[int, list[int]] = {}
    finish: dict[int, tuple] = {}
    order = []
    for _ in range(limit):
        if not runner.has_work():
            break
        for ev in runner.step():
            assert ev.request_id not in finish, "event after the final one"
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
            order.append(ev.request_id)
            if ev.finish:
                finish[ev.request_id] = (ev.finish, ev.error)
    else:
        raise AssertionError("runner never finished")
    return got, finish, order


def _expected(prompt, n=6):
    return [100 + 10 * (prompt[-1] % 10) + i for i in range(n)]


def test_runner_serves_interleaved_requests_and_routes_by_id(backend, monkeypatch):
    _distinct_scripts(monkeypatch)
    monkeypatch.setattr(_executor_cls(), "per_call", 1)    # one response per await: interleaved
    runner = backend.make_runner()
    prompts = {i: [50 + i, 60 + i, i] for i in range(1, 5)}
    for i, p in prompts.items():
        runner.add(i, p, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    assert runner.stats().running == 4
    got, finish, _ = _drive(runner)
    assert got == {i: _expected(p) for i, p in prompts.items()}
    assert finish == {i: ("length", None) for i in prompts}
    ex = _executor(backend)
    assert ex.max_in_flight == 4                           # all four in one batch
    log = [rid for rid, toks, final, err in ex.log if toks]
    first_final = min(i for i, (rid, toks, final, err) in enumerate(ex.log) if final)
    assert len(set(log[:first_final])) == 4                # interleaved before anyone finished
    assert not runner.has_work() and runner.stats().running == 0


def test_more_requests_than_the_batch_wait_in_the_executor(backend, monkeypatch):
    _distinct_scripts(monkeypatch, n_tokens=3)
    runner = backend.make_runner()
    prompts = {i: [70, i] for i in range(1, 11)}           # 10 > max_batch_size 8
    for i, p in prompts.items():
        runner.add(i, p, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    assert (runner.stats().running, runner.stats().waiting) == (8, 2)
    got, finish, _ = _drive(runner)
    assert got == {i: _expected(p, 3) for i, p in prompts.items()}
    assert _executor(backend).max_in_flight == 8


def test_abort_one_request_keeps_the_others(backend, monkeypatch, fake_trtllm):
    _distinct_scripts(monkeypatch, n_tokens=12)
    ex = _executor(backend)
    ex.budget = 0                                          # the engine runs only when allowed
    runner = backend.make_runner()
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    for i in (1, 2, 3):
        runner.add(i, [i], params)
    exec_ids = {c["requests"][0].input_token_ids[0]: c["ids"][0]
                for c in calls(fake_trtllm, "enqueue_requests")}
    ex.allow(3)                                            # three tokens each
    seen: dict[int, list[int]] = {}
    for _ in range(500):
        for ev in runner.step():
            assert ev.finish is None
            seen.setdefault(ev.request_id, []).extend(ev.token_ids)
        if all(len(seen.get(i, [])) == 3 for i in (1, 2, 3)):
            break
    runner.abort(2)
    assert calls(fake_trtllm, "cancel_request") == [{"id": exec_ids[2]}]
    ex.allow(100)
    got, finish, _ = _drive(runner)
    assert finish[2] == ("cancelled", None) and got[2] == []       # nothing after the abort
    for i in (1, 3):
        assert seen[i] + got[i] == _expected([i], 12) and finish[i] == ("length", None)
    assert ex.requests[exec_ids[2]].cancelled


def test_an_error_fails_only_its_request_with_its_message(backend, monkeypatch):
    _distinct_scripts(monkeypatch)
    monkeypatch.setattr(_executor_cls(), "fail_for", staticmethod(
        lambda r: "Request input exceeds the KV cache" if r.input_token_ids == [2] else None))
    runner = backend.make_runner()
    for i in (1, 2, 3):
        runner.add(i, [i], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    got, finish, _ = _drive(runner)
    assert finish[2] == ("error", "TensorRT-LLM request failed: Request input exceeds the KV cache")
    assert got == {1: _expected([1]), 2: [], 3: _expected([3])}


def test_bad_request_is_an_error_event(backend):
    runner = backend.make_runner()
    runner.add(9, [30] * (backend.info.max_input_len + 1), SamplingParams(max_new_tokens=2))
    (ev,) = runner.step()
    assert ev.request_id == 9 and ev.finish == "error"
    assert "exceeds this backend's limits" in ev.error
    assert not runner.has_work()


def test_a_request_the_executor_refuses_is_one_line(backend, monkeypatch):
    def refuse(request):
        raise RuntimeError("[TensorRT-LLM][ERROR] Assertion failed: too many stop words\n  at ...")

    monkeypatch.setattr(_executor(backend), "enqueue_request", refuse)
    runner = backend.make_runner()
    runner.add(1, [5, 6], SamplingParams(max_new_tokens=2))
    (ev,) = runner.step()
    assert ev.finish == "error" and ev.error == (
        "TensorRT-LLM rejected the request: [TensorRT-LLM][ERROR] Assertion failed: too many "
        "stop words")
    with pytest.raises(TrtllmRuntimeError, match="rejected the request"):
        list(backend.stream([5, 6], SamplingParams(max_new_tokens=2)))


def test_a_broken_executor_fails_every_request_in_flight(backend, monkeypatch):
    ex = _executor(backend)
    ex.budget = 0
    runner = backend.make_runner()
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    runner.add(1, [1], params)
    runner.add(2, [2], params)

    def broken(*a, **k):
        raise RuntimeError("[TensorRT-LLM][ERROR] CUDA runtime error in cudaMemcpyAsync: an "
                           "illegal memory access was encountered\n  at ...")

    monkeypatch.setattr(ex, "await_responses", broken)
    got, finish, _ = _drive(runner)
    why = ("TensorRT-LLM request failed: executor failed: [TensorRT-LLM][ERROR] CUDA runtime "
           "error in cudaMemcpyAsync: an illegal memory access was encountered")
    assert finish == {1: ("error", why), 2: ("error", why)}
    runner.add(3, [3], params)
    (ev,) = runner.step()
    assert ev.finish == "error" and ev.error.startswith("TensorRT-LLM executor failed: ")


def test_stream_and_runner_share_the_dispatcher(backend, monkeypatch):
    _distinct_scripts(monkeypatch, n_tokens=5)
    monkeypatch.setattr(_executor_cls(), "per_call", 1)
    runner = backend.make_runner()
    params = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    runner.add(1, [1], params)
    runner.add(2, [2], params)
    out = {}
    t = threading.Thread(target=lambda: out.update(s=list(backend.stream([7], params))))
    t.start()
    got, finish, _ = _drive(runner)
    t.join(10)
    assert got == {1: _expected([1], 5), 2: _expected([2], 5)}
    assert out["s"] == _expected([7], 5)


# ---------------------------------------------------------------- the fake follows upstream's traps

def test_upstream_generate_hides_the_error_and_steals_responses(fake_trtllm, engine_dir):
    """Why the backend does not use ModelRunnerCpp.generate (model_runner_cpp.py @03832911)."""
    import torch
    from tensorrt_llm.bindings.executor import Executor
    from tensorrt_llm.runtime import ModelRunnerCpp

    runner = ModelRunnerCpp.from_dir(str(engine_dir))
    ids = [torch.tensor([5, 6], dtype=torch.int32)]
    kw = dict(max_new_tokens=4, end_id=0, pad_id=0, streaming=True, return_dict=True,
              output_sequence_lengths=True)
    first = runner.generate(ids, **kw)
    out = next(first)
    assert out["output_ids"].device.type == "cuda"               # _fill_output: device=cuda
    with pytest.raises(TypeError, match="can't convert cuda"):
        out["output_ids"].numpy()
    second = runner.generate(ids, **kw)       # a concurrent call: responses are not filtered
    with pytest.raises(ValueError, match="is not in list"):       # request_ids.index
        for _ in range(10):
            next(second)
    Executor.error_after = 0
    try:
        third = ModelRunnerCpp.from_dir(str(engine_dir)).generate(ids, **kw)
        with pytest.raises(RuntimeError, match="Cannot get the result for a response with an"):
            next(third)
    finally:
        del Executor.error_after


# ---------------------------------------------------------------- load guards and auto

def test_engine_for_another_gpu_says_what_to_build(fake_trtllm, monkeypatch, engine_dir):
    set_gpu(monkeypatch, "h200")
    with pytest.raises(EngineMismatchError) as e:
        load_trtllm(engine=str(engine_dir), warmup=False)
    msg = str(e.value)
    assert "built for NVIDIA A10 (sm86), this GPU is NVIDIA H200 (sm90)" in msg
    assert "`make engine GPU=h200`" in msg
    assert calls(fake_trtllm, "ModelRunnerCpp.from_dir") == []   # TensorRT never saw the plan


def test_engine_from_other_library_versions(fake_trtllm, monkeypatch, engine_dir):
    set_gpu(monkeypatch, "a10")
    m = json.loads((engine_dir / "manifest.json").read_text())
    m["versions"]["tensorrt"] = "10.11.0"
    (engine_dir / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineMismatchError,
                       match=r"built with tensorrt 10.11.0, this machine has tensorrt 10.13.3.9.*"
                             r"make engine GPU=a10"):
        load_trtllm(engine=str(engine_dir), warmup=False)


def test_auto_found_folder_built_with_other_libraries(fake_trtllm, monkeypatch, engine_dir):
    set_gpu(monkeypatch, "a10")
    monkeypatch.setenv("QWEN_TRT_ENGINES_DIR", str(engine_dir.parent))
    m = json.loads((engine_dir / "manifest.json").read_text())
    m["versions"]["tensorrt_llm"] = "1.1.0"
    (engine_dir / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineMismatchError, match=r"built with tensorrt_llm 1.1.0, this machine "
                                                  r"has tensorrt_llm 1.2.1"):
        load_trtllm(warmup=False)


def test_no_engine_for_this_gpu_serves_the_checkpoint(fake_trtllm, monkeypatch, tmp_path,
                                                      tiny_model_dir):
    """No engine folder: the LLM API path (tests/test_trtllm_llmapi.py), not an error."""
    set_gpu(monkeypatch, "l4")
    monkeypatch.setenv("QWEN_TRT_ENGINES_DIR", str(tmp_path / "none"))
    b = load_trtllm(model=str(tiny_model_dir), warmup=False)
    try:
        assert b.info.path == "llmapi" and calls(fake_trtllm, "ModelRunnerCpp.from_dir") == []
    finally:
        b.close()


def test_engine_path_says_so(backend):
    assert backend.info.path == "engine"
    assert backend.info.describe().startswith("trtllm (TensorRT engine) · ")
    assert backend.make_runner().stats().extra["path"] == "engine"


def test_folder_without_manifest(fake_trtllm, monkeypatch, engine_dir):
    from qwen_trt.engine.manifest import ManifestError

    set_gpu(monkeypatch, "a10")
    (engine_dir / "manifest.json").unlink()
    with pytest.raises(ManifestError, match="has no manifest.json: it was not built by"):
        load_trtllm(engine=str(engine_dir), warmup=False)


def test_auto_engine_dir_picks_this_gpus_engine(fake_trtllm, monkeypatch, engine_dir):
    from qwen_trt.backends import BackendConfig, choose_backend

    monkeypatch.setenv("QWEN_TRT_ENGINES_DIR", str(engine_dir.parent))
    set_gpu(monkeypatch, "a10")
    assert auto_engine_dir() == engine_dir
    assert choose_backend(BackendConfig()) == "trtllm"
    set_gpu(monkeypatch, "h200")
    assert auto_engine_dir() is None
    assert choose_backend(BackendConfig()) == "torch"


def test_auto_engine_dir_never_raises(fake_trtllm, monkeypatch, engine_dir):
    import qwen_trt.engine.gpu as gpu_mod

    monkeypatch.setenv("QWEN_TRT_ENGINES_DIR", str(engine_dir.parent))

    def boom(index=0):
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(gpu_mod, "detect_gpu", boom)
    assert auto_engine_dir() is None


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None,
                    reason="a real tensorrt_llm is installed")
def test_without_tensorrt_llm(monkeypatch, engine_dir):
    from qwen_trt.engine.env import TrtllmNotInstalledError

    monkeypatch.setenv("QWEN_TRT_ENGINES_DIR", str(engine_dir.parent))
    set_gpu(monkeypatch, "a10")
    assert auto_engine_dir() is None
    with pytest.raises(TrtllmNotInstalledError, match=r'pip install -e "\.\[trtllm\]"'):
        load_trtllm(engine=str(engine_dir), warmup=False)
