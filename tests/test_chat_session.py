"""Token budget: oldest whole turns go first; system prompt and newest message always stay."""
import pytest

from qwen_trt.chat.session import ChatSession, prompt_budget, render_prompt_ids
from qwen_trt.errors import EmptyMessageError, PromptTooLongError


def _session(tok, n_turns, system="You are a helpful assistant."):
    s = ChatSession(tok, system_prompt=system)
    for i in range(n_turns):
        s.add_exchange(f"question number {i} about GPUs", f"answer number {i}: 你好 🚀")
    return s


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


def test_everything_fits(tiny_tokenizer):
    s = _session(tiny_tokenizer, 3)
    plan = s.prepare("next", max_input_len=4000, max_seq_len=4096, max_new_tokens=64)
    assert plan.dropped_turns == 0 and plan.used_turns == 3
    msgs = [{"role": "system", "content": s.system_prompt}]
    for u, a in s.turns():
        msgs += [u.as_template_dict(), a.as_template_dict()]
    msgs.append({"role": "user", "content": "next"})
    assert plan.ids == render_prompt_ids(tiny_tokenizer, msgs)
    assert _decode(tiny_tokenizer, plan.ids).endswith("<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n")


def test_oldest_turns_dropped_first_and_minimally(tiny_tokenizer):
    s = _session(tiny_tokenizer, 12)
    full = s.prepare("latest question", max_input_len=100000, max_seq_len=100000, max_new_tokens=1)
    limit_seq, new = len(full.ids) - 40 + 128, 128   # budget 40 tokens short of everything
    plan = s.prepare("latest question", max_input_len=100000, max_seq_len=limit_seq, max_new_tokens=new)
    assert plan.dropped_turns > 0
    assert len(plan.ids) <= plan.token_budget == limit_seq - new
    text = _decode(tiny_tokenizer, plan.ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert "latest question" in text
    kept = range(plan.dropped_turns, 12)
    for i in range(12):  # whole turns only: both halves present or both absent
        q, a = f"question number {i} ", f"answer number {i}:"
        assert (q in text) == (a in text) == (i in kept)
    # minimal: keeping one more (older) turn would not fit
    bigger = ChatSession(tiny_tokenizer, system_prompt=s.system_prompt,
                         messages=s.messages[2 * (plan.dropped_turns - 1):])
    more = bigger.prepare("latest question", max_input_len=10**6, max_seq_len=10**6, max_new_tokens=1)
    assert len(more.ids) > plan.token_budget


def test_input_limit_also_applies(tiny_tokenizer):
    s = _session(tiny_tokenizer, 8)
    plan = s.prepare("q", max_input_len=120, max_seq_len=100000, max_new_tokens=10)
    assert len(plan.ids) <= 120 and plan.token_budget == 120 and plan.dropped_turns > 0


def test_newest_message_alone_too_long_is_a_clear_error(tiny_tokenizer):
    s = _session(tiny_tokenizer, 2)
    with pytest.raises(PromptTooLongError, match=r"prompt limit is 50 tokens"):
        s.prepare("word " * 500, max_input_len=4000, max_seq_len=306, max_new_tokens=256)
    assert len(s.messages) == 4  # nothing lost


def test_empty_message_and_no_room(tiny_tokenizer):
    s = _session(tiny_tokenizer, 0)
    for empty in ("", "   \n\t"):
        with pytest.raises(EmptyMessageError):
            s.prepare(empty, max_input_len=100, max_seq_len=200, max_new_tokens=10)
    with pytest.raises(PromptTooLongError, match="leaves no room"):
        s.prepare("hi", max_input_len=100, max_seq_len=200, max_new_tokens=200)
    assert prompt_budget(100, 200, 50) == 100 and prompt_budget(1000, 200, 50) == 150


def test_system_prompt_optional_and_clear(tiny_tokenizer):
    s = _session(tiny_tokenizer, 2, system=None)
    plan = s.prepare("hey", max_input_len=4000, max_seq_len=4096, max_new_tokens=8)
    assert "<|im_start|>system" not in _decode(tiny_tokenizer, plan.ids)
    s.clear()
    assert s.messages == [] and s.turns() == []
    plan = s.prepare("hey", max_input_len=4000, max_seq_len=4096, max_new_tokens=8)
    assert _decode(tiny_tokenizer, plan.ids) == "<|im_start|>user\nhey<|im_end|>\n<|im_start|>assistant\n"


def test_piece_encoding_equals_encoding_the_whole_prompt(tiny_tokenizer):
    """The session encodes each rendered message once and reuses it; the ids must be exactly
    those of encoding the whole rendered prompt, whatever the text (specials typed by the user,
    Chinese, emoji, whitespace at the edges)."""
    import random

    from qwen_trt.chat.session import PieceEncoder

    rng = random.Random(0)
    atoms = ["hello", " ", "\n", "你好", "🚀", "龘", "<|im_start|>", "<|im_end|>", "\t", "  x ",
             "def f():\n    return 1", "é", "\u0301", "<|endoftext|>"]
    enc = PieceEncoder(tiny_tokenizer)
    assert enc._split
    for _ in range(200):
        s = ChatSession(tiny_tokenizer, system_prompt=rng.choice([None, "Be brief. 简短", " "]))
        for _ in range(rng.randrange(0, 5)):
            s.add_exchange("".join(rng.choice(atoms) for _ in range(rng.randrange(1, 6))),
                           "".join(rng.choice(atoms) for _ in range(rng.randrange(0, 6))))
        new = "q" + "".join(rng.choice(atoms) for _ in range(rng.randrange(1, 6)))
        plan = s.prepare(new, max_input_len=10**6, max_seq_len=10**6, max_new_tokens=1)
        msgs = s._template_messages(s.turns(), new)
        assert plan.ids == render_prompt_ids(tiny_tokenizer, msgs)
        assert enc.encode(tiny_tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True)) == plan.ids
