"""ReplyStream over any backend: deltas, metrics, finish reasons (a scripted backend)."""
import pytest
import torch

from fakes import ScriptedBackend
from qwen_trt.serving.generation import ReplyStream
from qwen_trt.params import SamplingParams
from qwen_trt.fast.step.sampling import SamplerState, pick, sampler_kind


TEXT = "你好！Emoji 🚀🎉 and 龘. **Markdown** <script>alert(1)</script>"


def test_chinese_and_emoji_stream_exactly(tiny_tokenizer):
    b = ScriptedBackend(tiny_tokenizer, TEXT)
    rs = ReplyStream(b, [1, 2, 3], SamplingParams(max_new_tokens=500))
    deltas = list(rs)
    assert "".join(deltas) == TEXT == rs.reply.text
    assert all("\ufffd" not in d for d in deltas)
    assert len(deltas) > 5                               # it really streamed
    m = rs.reply.metrics
    assert m.finish_reason == "stop" and m.tokens == len(b.script()) and m.prompt_tokens == 3
    assert m.total_ms >= m.ttft_ms > 0


def test_length_and_cancel(tiny_tokenizer):
    b = ScriptedBackend(tiny_tokenizer, TEXT)
    rs = ReplyStream(b, [1], SamplingParams(max_new_tokens=4))
    list(rs)
    assert rs.reply.metrics.finish_reason == "length" and rs.reply.metrics.tokens == 4
    with ReplyStream(b, [1], SamplingParams(max_new_tokens=500)) as rs:
        for i, _ in enumerate(rs):
            if i == 2:
                break
    assert rs.reply.metrics.finish_reason == "cancelled"
    assert TEXT.startswith(rs.reply.text) and 0 < len(rs.reply.text) < len(TEXT)


def test_to_json_fields(tiny_tokenizer):
    rs = ReplyStream(ScriptedBackend(tiny_tokenizer, "hi"), [1], SamplingParams(), dropped_turns=2)
    list(rs)
    j = rs.reply.to_json()
    assert set(j) >= {"text", "finish_reason", "ttft_ms", "tokens", "tok_s", "dropped_turns"}
    assert j["text"] == "hi" and j["dropped_turns"] == 2 and j["finish_reason"] == "stop"


def test_sampling_params_validation():
    for bad in (dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=-0.1), dict(top_p=1.5),
                dict(top_k=-1), dict(frequency_penalty=2.5), dict(min_p=1.1), dict(min_p=-0.1),
                dict(logprobs=21), dict(logprobs=-1), dict(logprobs=True),
                dict(grammar="json_object")):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert SamplingParams(top_p=0).greedy          # OpenAI's spec allows 0: greedy
    assert not SamplingParams().greedy
    assert SamplingParams(frequency_penalty=0.5).penalized


def _draws(logits, params, n=200):
    st = SamplerState(n, logits.shape[-1], "cpu")
    st.set(params)
    kind = sampler_kind(params)
    out = set()
    for i in range(n):
        st.step.fill_(i)
        out.add(int(pick(logits, kind, st)))
    return out


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert _draws(logits, SamplingParams(temperature=1.0, top_k=2, top_p=1.0, seed=0,
                                         max_new_tokens=200)) == {0, 1}
    p = logits.softmax(-1)[0]                  # 0.636, 0.234, 0.086, ...
    assert p[0] < 0.8 < p[0] + p[1]
    assert _draws(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.8, seed=0,
                                         max_new_tokens=200)) == {0, 1}
    # the top token always survives
    assert _draws(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.1, seed=0,
                                         max_new_tokens=200)) == {0}
    assert _draws(logits, SamplingParams(temperature=0, max_new_tokens=200)) == {0}


def test_penalties_apply_per_row_to_generated_tokens_only():
    logits = torch.tensor([[4.0, 3.0, 2.0, -1.0], [4.0, 3.0, 2.0, -1.0]])
    st = SamplerState(8, 4, "cpu", rows=2)
    st.set(SamplingParams(temperature=0, presence_penalty=1.5), row=0)
    st.set(SamplingParams(temperature=0), row=1)              # neutral penalties
    kind = "greedy+penalties"
    assert pick(logits, kind, st).tolist() == [0, 0]          # nothing generated yet
    st.advance(torch.tensor([0, 0]))
    assert pick(logits, kind, st).tolist() == [1, 0]          # 4 - 1.5 < 3 on row 0 only
    st.set(SamplingParams(temperature=0, repetition_penalty=2.0), row=0)
    st.advance(torch.tensor([0, 0]))
    assert pick(logits, kind, st).tolist() == [1, 0]          # 4 / 2 < 3
    pen = st.penalize(logits)
    assert pen[0].tolist() == [2.0, 3.0, 2.0, -1.0] and torch.equal(pen[1], logits[1])
    st.advance(torch.tensor([3, 3]))
    assert st.penalize(logits)[0, 3] == -2.0                  # negative logits are multiplied
    assert sampler_kind(SamplingParams(temperature=0)) == "greedy"
    assert sampler_kind(SamplingParams(top_k=20, repetition_penalty=1.1)) == "topk+penalties"


def test_penalty_ranges():
    for bad in (dict(presence_penalty=2.5), dict(presence_penalty=-2.1),
                dict(repetition_penalty=0), dict(repetition_penalty=2.01)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert not SamplingParams(presence_penalty=0.0, repetition_penalty=1.0).penalized
    assert SamplingParams(presence_penalty=-2, repetition_penalty=2).penalized


def test_cancel_before_the_first_token_is_never_lost(tiny_tokenizer):
    """A cancel that lands before the backend's stream begins (which clears the backend's own
    flag) still stops the request: the engine is not even asked."""
    import threading

    b = ScriptedBackend(tiny_tokenizer, TEXT)
    ev = threading.Event()
    ev.set()
    rs = ReplyStream(b, [1, 2], SamplingParams(max_new_tokens=50), cancel=ev)
    assert list(rs) == [] and b.prompts == []
    assert rs.reply.metrics.finish_reason == "cancelled" and rs.reply.metrics.tokens == 0
    rs = ReplyStream(b, [1, 2], SamplingParams(max_new_tokens=50))
    rs.cancel()
    assert list(rs) == [] and rs.reply.metrics.finish_reason == "cancelled"


def test_cancel_mid_stream_stops_after_the_current_token(tiny_tokenizer):
    import threading

    b = ScriptedBackend(tiny_tokenizer, TEXT)
    ev = threading.Event()
    rs = ReplyStream(b, [1], SamplingParams(max_new_tokens=500), cancel=ev)
    it = iter(rs)
    next(it)
    n = rs.reply.metrics.tokens
    ev.set()
    rest = list(it)
    assert rest == [] and rs.reply.metrics.tokens == n < len(b.script())
    assert rs.reply.metrics.finish_reason == "cancelled" and TEXT.startswith(rs.reply.text)
