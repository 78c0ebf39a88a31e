"""The torch backend on the tiny model (CPU, float32): determinism, parity with HF generate,
stops, limits, cancellation, and the streamed text equal to the final decode."""
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen_trt.backends.torch_backend import TorchBackend
from qwen_trt.serving.generation import ReplyStream
from qwen_trt.model.template import default_stop_ids
from qwen_trt.errors import EmptyMessageError, PromptTooLongError
from qwen_trt.params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "你好, tell me 🚀"}],
                                              tokenize=False, add_generation_prompt=True)
    return tiny_tokenizer.encode(text, add_special_tokens=False)


def test_greedy_is_deterministic_and_equals_hf_generate(tiny_backend, prompt):
    a = list(tiny_backend.stream(prompt, GREEDY))
    b = list(tiny_backend.stream(prompt, GREEDY))
    assert a == b and len(a) == 24
    hf = tiny_backend.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
    assert a == hf[0, len(prompt):].tolist()


def test_seeded_sampling_repeats_and_seeds_differ(tiny_backend, prompt):
    def run(seed):
        p = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=1.0, top_k=0, seed=seed,
                           ignore_eos=True)
        return list(tiny_backend.stream(prompt, p))

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_max_new_tokens_gives_length(tiny_backend, prompt):
    rs = ReplyStream(tiny_backend, prompt, SamplingParams(max_new_tokens=5, temperature=0,
                                                          ignore_eos=True))
    list(rs)
    assert rs.reply.metrics.tokens == 5 and rs.reply.metrics.finish_reason == "length"
    assert rs.reply.metrics.ttft_ms > 0 and rs.reply.metrics.prompt_tokens == len(prompt)


def test_stops_at_a_stop_token_mid_stream(tiny_backend, prompt):
    sampled = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=0, seed=3,
                             ignore_eos=True)
    free = list(tiny_backend.stream(prompt, sampled))
    defaults = set(tiny_backend.info.stop_token_ids)
    k = next(i for i, t in enumerate(free) if t not in free[:i] and i >= 2)
    assert not defaults & set(free[:k + 1])   # only the extra stop id can end this reply
    stop_at = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=0, seed=3,
                             stop_token_ids=(free[k],))
    rs = ReplyStream(tiny_backend, prompt, stop_at)
    text = "".join(rs)
    assert rs.reply.metrics.finish_reason == "stop"
    assert rs.reply.metrics.tokens == k + 1          # the stop token is counted, not shown
    assert text == tiny_backend.tokenizer.decode(free[:k], skip_special_tokens=True)


@pytest.fixture(scope="module")
def im_end_backend(tiny_model_dir, tmp_path_factory, tiny_tokenizer):
    """The tiny model edited so that <|im_end|> wins the argmax: one hidden feature is large in
    every embedding and larger still in <|im_end|>'s (embeddings are tied to the LM head)."""
    d = tmp_path_factory.mktemp("tiny-im-end")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, d / f.name)
    w = load_file(d / "model.safetensors")
    emb = w["model.embed_tokens.weight"]
    emb[:, 0] = 3.0
    emb[tiny_tokenizer.convert_tokens_to_ids("<|im_end|>"), 0] = 9.0
    w["model.norm.weight"][0] = 5.0
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    return TorchBackend.load(str(d), device="cpu", warmup=False)


def test_stops_cleanly_at_im_end(im_end_backend, prompt):
    rs = ReplyStream(im_end_backend, prompt, SamplingParams(max_new_tokens=16, temperature=0))
    text = "".join(rs)
    im_end = im_end_backend.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert rs.reply.metrics.finish_reason == "stop"
    assert rs.reply.token_ids == [] or im_end not in rs.reply.token_ids
    assert "<|im_end|>" not in text and rs.reply.metrics.tokens < 16
    assert im_end in default_stop_ids(im_end_backend.tokenizer)
    assert im_end_backend.info.stop_token_ids == default_stop_ids(im_end_backend.tokenizer)
    # ignore_eos (benchmarks) runs through it
    rs = ReplyStream(im_end_backend, prompt,
                     SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    list(rs)
    assert rs.reply.metrics.tokens == 6 and rs.reply.metrics.finish_reason == "length"


def test_default_stop_ids_are_im_end_and_endoftext(tiny_tokenizer):
    ids = default_stop_ids(tiny_tokenizer)
    assert set(ids) == {tiny_tokenizer.convert_tokens_to_ids("<|im_end|>"),
                        tiny_tokenizer.convert_tokens_to_ids("<|endoftext|>")}


def test_streamed_text_equals_final_decode_when_sampling(tiny_backend, prompt):
    for seed in range(5):
        p = SamplingParams(max_new_tokens=40, temperature=1.2, top_p=1.0, top_k=0, seed=seed)
        rs = ReplyStream(tiny_backend, prompt, p)
        streamed = "".join(rs)
        decoded = tiny_backend.tokenizer.decode(
            [t for t in rs.reply.token_ids], skip_special_tokens=True)
        assert streamed == rs.reply.text == decoded


def test_close_mid_stream_cancels_and_backend_serves_next(tiny_backend, prompt):
    rs = ReplyStream(tiny_backend, prompt, SamplingParams(max_new_tokens=50, temperature=0,
                                                          ignore_eos=True))
    it = iter(rs)
    got = 0
    for _ in it:
        got += 1
        if rs.reply.metrics.tokens >= 3:
            break
    rs.close()
    assert rs.reply.metrics.finish_reason == "cancelled" and rs.reply.metrics.tokens == 3
    assert len(list(tiny_backend.stream(prompt, GREEDY))) == 24   # not left cancelled


def test_cancel_from_another_thread(tiny_backend, prompt):
    p = SamplingParams(max_new_tokens=2000, temperature=0, ignore_eos=True)
    seen = []
    started = threading.Event()

    def consume():
        for tok in tiny_backend.stream(prompt, p):
            seen.append(tok)
            started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(10)
    tiny_backend.cancel()
    t.join(10)
    assert not t.is_alive() and 0 < len(seen) < 2000


def test_prompt_plus_reply_over_limit_is_rejected(tiny_backend):
    too_long = [5] * tiny_backend.info.max_seq_len
    with pytest.raises(PromptTooLongError, match="exceeds this backend's limits"):
        next(iter(ReplyStream(tiny_backend, too_long, SamplingParams(max_new_tokens=1))))
    with pytest.raises(EmptyMessageError, match="The prompt is empty"):
        tiny_backend.check_request([], SamplingParams())
    tiny_backend.check_request([5] * 10, SamplingParams(max_new_tokens=10))   # fits: no error


def test_info_describes_the_backend(tiny_backend, tiny_model_dir):
    info = tiny_backend.info
    assert (info.name, info.device, info.dtype) == ("torch", "cpu", "float32")
    assert info.max_seq_len == 4096 and info.model == str(tiny_model_dir)
    assert "torch" in info.describe()


@pytest.mark.cuda
def test_cuda_greedy_matches_hf_generate(tiny_model_dir, prompt):
    b = TorchBackend.load(str(tiny_model_dir), device="cuda", dtype="float32")
    ours = list(b.stream(prompt, GREEDY))
    hf = b.model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=24,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == hf[0, len(prompt):].tolist()


def test_neutral_penalties_keep_greedy_and_penalties_change_it(tiny_backend, prompt):
    plain = list(tiny_backend.stream(prompt, GREEDY))
    from qwen_trt.fast.step import sampling

    real = sampling.sampler_kind
    sampling.sampler_kind = lambda p: real(p) + sampling.PENALTIES   # neutral values, applied
    try:
        assert list(tiny_backend.stream(prompt, GREEDY)) == plain
    finally:
        sampling.sampler_kind = real
    strong = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True,
                            repetition_penalty=2.0, presence_penalty=2.0)
    penalized = list(tiny_backend.stream(prompt, strong))
    assert penalized != plain
    assert len(set(penalized)) >= len(set(plain))   # fewer repeats
