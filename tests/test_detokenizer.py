"""Incremental detokenization never splits a character and adds up to the full decode."""
import random

import pytest

from qwen_trt.model.detokenizer import REPLACEMENT, IncrementalDetokenizer

TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji: 🚀🎉👍 and 龘 (a rare character).",
    "def f(x):\n    return x * 2  # 注释 ✅",
    "Привет, мир! こんにちは 안녕하세요 café",
]


def _stream(tokenizer, ids):
    d = IncrementalDetokenizer(tokenizer)
    deltas = [d.add(i) for i in ids]
    return deltas, d.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_and_never_split_a_character(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    deltas, tail = _stream(tiny_tokenizer, ids)
    assert "".join(deltas) + tail == text
    assert tail == ""  # valid text: nothing is left held back at the end
    for delta in deltas:
        assert REPLACEMENT not in delta
    # some tokens produced nothing on their own (a character split over several tokens)
    assert any(delta == "" for delta in deltas) == any(
        REPLACEMENT in tiny_tokenizer.decode([i]) for i in ids)


def test_special_tokens_are_skipped(tiny_tokenizer):
    ids = tiny_tokenizer.encode("你好<|im_end|>", add_special_tokens=False)
    deltas, tail = _stream(tiny_tokenizer, ids)
    assert "".join(deltas) + tail == "你好"


def test_random_token_soup_matches_full_decode(tiny_tokenizer):
    """Arbitrary ids (invalid UTF-8 byte runs included): what was shown is never taken back,
    and the whole adds up exactly."""
    rng = random.Random(0)
    vocab = len(tiny_tokenizer)
    for _ in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        d = IncrementalDetokenizer(tiny_tokenizer)
        for n, i in enumerate(ids, 1):
            d.add(i)
            assert tiny_tokenizer.decode(ids[:n], skip_special_tokens=True).startswith(d.text)
        d.flush()
        assert d.text == tiny_tokenizer.decode(ids, skip_special_tokens=True)


def test_invalid_bytes_keep_streaming(tiny_tokenizer):
    """A model that emits an invalid byte over and over still streams, one char behind."""
    bad = next(i for i in range(len(tiny_tokenizer))
               if tiny_tokenizer.decode([i, i, i]) == REPLACEMENT * 3)
    d = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [d.add(bad) for _ in range(5)]
    assert deltas == ["", REPLACEMENT, REPLACEMENT, REPLACEMENT, REPLACEMENT]
    assert d.flush() == REPLACEMENT


def test_completed_character_is_emitted_whole(tiny_tokenizer):
    ids = tiny_tokenizer.encode("a龘b", add_special_tokens=False)
    d = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [d.add(i) for i in ids]
    assert [x for x in deltas if x] == ["a", "龘", "b"]


def test_a_fast_tokenizer_decodes_through_its_rust_tokenizer(tiny_tokenizer):
    """The serving loop's decode skips transformers' wrapper for a fast tokenizer (same text:
    the tests above compare with ``tokenizer.decode``); a tokenizer without one keeps it."""
    assert IncrementalDetokenizer(tiny_tokenizer)._rust is tiny_tokenizer.backend_tokenizer

    class Slow:
        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
            return tiny_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tiny_tokenizer.encode("héllo wörld 你好", add_special_tokens=False)
    slow = IncrementalDetokenizer(Slow())
    assert slow._rust is None
    assert "".join(slow.add(i) for i in ids) + slow.flush() == "héllo wörld 你好"
