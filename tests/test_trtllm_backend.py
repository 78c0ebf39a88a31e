"""The trtllm backend by contract: fake tensorrt_llm 1.2.1 runner, pretend GPU, tiny model."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fake_trtllm.support import FAKE_DIR, calls, fake_trtllm, set_gpu  # noqa: E402,F401

from qwen_trt.backends.trtllm_backend import (NO_END_ID, OutputDeltas, TrtllmBackend,  # noqa: E402
                                              TrtllmRuntimeError, auto_engine_dir,
                                              final_stop_token, request_ids_for, runner_kwargs,
                                              sampling_kwargs)
from qwen_trt.chat.template import ENDOFTEXT, IM_END  # noqa: E402
from qwen_trt.errors import EngineMismatchError, PromptTooLongError  # noqa: E402
from qwen_trt.chat.generation import ReplyStream  # noqa: E402
from qwen_trt.params import SamplingParams  # noqa: E402

MAX_SEQ = 64


# ---------------------------------------------------------------- pure conversion

def _output(prompt, generated, end_id=7, max_seq=MAX_SEQ):
    """One streamed item shaped like ModelRunnerCpp._fill_output (return_dict, lengths)."""
    row = list(prompt) + list(generated)
    ids = torch.tensor([[row + [end_id] * (max_seq - len(row))]], dtype=torch.int32)
    return {"output_ids": ids, "sequence_lengths": torch.tensor([[len(row)]], dtype=torch.int32)}


def test_deltas_from_cumulative_prompt_prefixed_padded_outputs():
    prompt = [5, 6, 9, 9, 2]
    gen = [40, 41, 42, 43, 44, 45, 7]
    d = OutputDeltas(len(prompt), max_new_tokens=20)
    got = [d.update(_output(prompt, gen[:k])) for k in (1, 1, 4, 6, 7)]
    # one token, no new token, three at once, two at once, then the end id itself
    assert got == [[40], [], [41, 42, 43], [44, 45], [7]]
    assert d.emitted == 7


def test_deltas_ignore_the_padding_and_respect_max_new_tokens():
    prompt = [1, 2]
    d = OutputDeltas(2, max_new_tokens=3)
    out = _output(prompt, [9, 9, 9, 9, 9], end_id=9)   # padding equals real tokens
    assert d.update(out) == [9, 9, 9]
    assert d.update(out) == []


def test_final_stop_token():
    stops = (3, 4)
    assert final_stop_token([10, 11], 8, stops, end_id=3) == 3       # ended early, id hidden
    assert final_stop_token([10, 3], 8, stops, end_id=3) is None     # id shown already
    assert final_stop_token([10, 4], 8, stops, end_id=3) is None     # stop word shown
    assert final_stop_token([10] * 8, 8, stops, end_id=3) is None    # length
    assert final_stop_token([], 8, stops, end_id=3) == 3             # stopped at once
    assert final_stop_token([10], 8, (), end_id=NO_END_ID) is None   # ignore_eos


def test_request_ids_and_sampling_kwargs():
    p = SamplingParams(stop_token_ids=(100, 101, 102))
    r = request_ids_for(p, im_end=101, pad_id=100)
    assert (r.end_id, r.pad_id, r.stop_words) == (101, 100, (101, 100, 102))
    r = request_ids_for(SamplingParams(ignore_eos=True, stop_token_ids=(101,)), 101, 100)
    assert r.end_id == NO_END_ID and r.stop_words == ()
    assert sampling_kwargs(SamplingParams(temperature=0)) == {
        "temperature": 1.0, "top_k": 1, "top_p": 0.0}
    assert sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=3)) == {
        "temperature": 0.7, "top_k": 20, "top_p": 0.8, "random_seed": 3}


# ---------------------------------------------------------------- backend on the fake runner

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
    return TrtllmBackend.load(engine=str(engine_dir), warmup=False)


def _executor_cls():
    from tensorrt_llm.runtime import FakeExecutor

    return FakeExecutor


def _special(backend):
    return backend.tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])


def _prompt(backend):
    return backend.tokenizer.encode("Hello, how are you today?", add_special_tokens=False)


def test_load_passes_manifest_limits_to_model_runner(backend, fake_trtllm, engine_dir):
    (args,) = calls(fake_trtllm, "ModelRunnerCpp.from_dir")
    m = json.loads((engine_dir / "manifest.json").read_text())
    assert args["engine_dir"] == str(engine_dir)
    assert args["max_batch_size"] == m["limits"]["max_batch_size"]
    assert args["max_input_len"] == m["limits"]["max_input_len"]
    assert args["max_output_len"] is None       # runtime max_seq_len = the engine's
    assert args["kv_cache_free_gpu_memory_fraction"] == m["runtime"]["kv_cache_free_gpu_memory_fraction"]
    assert args["kv_cache_enable_block_reuse"] is True and args["enable_chunked_context"] is True
    assert backend.info.name == "trtllm" and backend.info.max_seq_len == m["limits"]["max_seq_len"]
    assert backend.info.device == "NVIDIA A10" and backend.info.dtype == "float16"
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


def test_outputs_are_padded_only_to_this_request(backend, monkeypatch):
    monkeypatch.setattr(_executor_cls(), "script", list(range(30, 60)))
    prompt = _prompt(backend)
    full = backend.runner.max_seq_len
    list(backend.stream(prompt, SamplingParams(max_new_tokens=5, temperature=0)))
    assert set(backend.runner.widths) == {len(prompt) + 5}
    assert backend.runner.max_seq_len == full == backend.info.max_seq_len
    gen = backend.stream(prompt, SamplingParams(max_new_tokens=9, temperature=0))
    next(gen)
    gen.close()
    assert backend.runner.max_seq_len == full


def test_generate_gets_end_pad_stop_words_and_sampling(backend, fake_trtllm):
    im_end, eot = _special(backend)
    prompt = _prompt(backend)
    params = SamplingParams(max_new_tokens=4, temperature=0.6, top_p=0.9, top_k=30, seed=7,
                            stop_token_ids=(im_end, eot))
    list(backend.stream(prompt, params))
    (g,) = calls(fake_trtllm, "generate")
    (ids,) = g["batch_input_ids"]
    assert ids.dtype == torch.int32 and ids.tolist() == prompt and ids.dim() == 1
    assert (g["end_id"], g["pad_id"]) == (im_end, eot)
    assert g["stop_words_list"] == [[[im_end], [eot]]]
    assert g["streaming"] and g["return_dict"] and g["output_sequence_lengths"]
    assert g["max_new_tokens"] == 4
    s = g["sampling"]
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (0.6, 30, 0.9, 7)


def test_greedy_is_top_k_1(backend, fake_trtllm):
    list(backend.stream(_prompt(backend), SamplingParams(max_new_tokens=2, temperature=0)))
    s = calls(fake_trtllm, "generate")[0]["sampling"]
    assert (s.top_k, s.top_p, s.temperature) == (1, None, 1.0)


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


def test_endoftext_stop_word_ends_the_reply(backend, monkeypatch, fake_trtllm):
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


def test_closing_the_generator_cancels_and_leaves_the_runner_clean(backend, monkeypatch,
                                                                   fake_trtllm):
    monkeypatch.setattr(_executor_cls(), "script", list(range(30, 60)))
    gen = backend.stream(_prompt(backend), SamplingParams(max_new_tokens=20, temperature=0))
    assert [next(gen), next(gen)] == [30, 31]
    gen.close()
    (enq,) = calls(fake_trtllm, "enqueue_requests")
    assert calls(fake_trtllm, "cancel_request") == [{"id": enq["ids"][0]}]
    # a response of the old request left in the executor would break the next call
    assert list(backend.stream(_prompt(backend), SamplingParams(max_new_tokens=4,
                                                                temperature=0))) == [30, 31, 32, 33]


def test_late_final_response_of_a_cancelled_request_is_ignored(backend, monkeypatch, fake_trtllm):
    """The executor acknowledges the cancel only after the next request started."""
    from datetime import timedelta

    monkeypatch.setattr(_executor_cls(), "script", list(range(30, 60)))
    monkeypatch.setattr(_executor_cls(), "late_cancel_ack", True)
    monkeypatch.setattr(backend, "drain_timeout_s", 0.2)
    gen = backend.stream(_prompt(backend), SamplingParams(max_new_tokens=20, temperature=0))
    next(gen)
    gen.close()                       # drain gives up after 0.2 s without the final response
    executor = backend.runner.executor._executor
    assert timedelta(milliseconds=50) in executor.timeouts   # the drain never blocks for ever
    toks = list(backend.stream(_prompt(backend), SamplingParams(max_new_tokens=3, temperature=0)))
    assert toks == [30, 31, 32]
    assert executor.requests[1].final_sent    # the old final response came, and was dropped


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
    assert len(calls(fake_trtllm, "cancel_request")) >= 1


def test_stop_token_then_close_does_not_cancel(backend, monkeypatch, fake_trtllm):
    im_end, _ = _special(backend)
    monkeypatch.setattr(_executor_cls(), "script", [30, im_end])
    rs = ReplyStream(backend, _prompt(backend), SamplingParams(max_new_tokens=10, temperature=0))
    list(rs)
    assert rs.reply.metrics.finish_reason == "stop"
    assert calls(fake_trtllm, "cancel_request") == []


def test_executor_error_is_one_line(backend, monkeypatch):
    monkeypatch.setattr(_executor_cls(), "error_after", 1)
    with pytest.raises(TrtllmRuntimeError, match="TensorRT-LLM request failed: Encountered an error"):
        list(backend.stream(_prompt(backend), SamplingParams(max_new_tokens=10, temperature=0)))


def test_prompt_longer_than_the_engine_allows(backend):
    too_long = [30] * (backend.info.max_input_len + 1)
    with pytest.raises(PromptTooLongError, match="exceeds this backend's limits"):
        backend.check_request(too_long, SamplingParams(max_new_tokens=1))


# ---------------------------------------------------------------- load guards and auto

def test_engine_for_another_gpu_says_what_to_build(fake_trtllm, monkeypatch, engine_dir):
    set_gpu(monkeypatch, "h200")
    with pytest.raises(EngineMismatchError) as e:
        TrtllmBackend.load(engine=str(engine_dir), warmup=False)
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
        TrtllmBackend.load(engine=str(engine_dir), warmup=False)


def test_auto_found_folder_built_with_other_libraries(fake_trtllm, monkeypatch, engine_dir):
    set_gpu(monkeypatch, "a10")
    monkeypatch.setenv("QWEN_TRT_ENGINES_DIR", str(engine_dir.parent))
    m = json.loads((engine_dir / "manifest.json").read_text())
    m["versions"]["tensorrt_llm"] = "1.1.0"
    (engine_dir / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineMismatchError, match=r"built with tensorrt_llm 1.1.0, this machine "
                                                  r"has tensorrt_llm 1.2.1"):
        TrtllmBackend.load(warmup=False)


def test_no_engine_for_this_gpu(fake_trtllm, monkeypatch, tmp_path):
    from qwen_trt.backends.trtllm_backend import EngineNotFoundError

    set_gpu(monkeypatch, "l4")
    monkeypatch.setenv("QWEN_TRT_ENGINES_DIR", str(tmp_path / "none"))
    with pytest.raises(EngineNotFoundError, match=r"No TensorRT-LLM engine for this GPU \(L4 "
                                                  r".*`make engine GPU=l4`"):
        TrtllmBackend.load(warmup=False)


def test_folder_without_manifest(fake_trtllm, monkeypatch, engine_dir):
    from qwen_trt.engine.manifest import ManifestError

    set_gpu(monkeypatch, "a10")
    (engine_dir / "manifest.json").unlink()
    with pytest.raises(ManifestError, match="has no manifest.json: it was not built by"):
        TrtllmBackend.load(engine=str(engine_dir), warmup=False)


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
        TrtllmBackend.load(engine=str(engine_dir), warmup=False)
