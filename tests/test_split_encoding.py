"""A long text is encoded in pieces in parallel (serving.session.split_for_encoding): the ids
must be exactly the whole text's, for any text, with the tiny model's tokenizer (Qwen2's
pre-tokenizer) and, where this machine has it, Qwen's real one (.dev-tok)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from qwen_trt.serving import session
from qwen_trt.serving.session import _codec, split_for_encoding

ALPHABET = st.sampled_from(list("abcXYZ éüßжк中文日本 \n\t.,'!?-_0123456789") + ["  ", "'s", "'ll"])
TEXT = st.lists(ALPHABET, min_size=0, max_size=400).map("".join)


def _plain(codec, text):
    return list(codec._encoding(text).ids) if text else []


@pytest.fixture(scope="module")
def tokenizers_(tiny_tokenizer):
    toks = [tiny_tokenizer]
    real = Path(__file__).resolve().parents[1] / ".dev-tok"
    if (real / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        toks.append(AutoTokenizer.from_pretrained(str(real)))
    return toks


@settings(max_examples=150, deadline=None)
@given(text=TEXT, piece=st.integers(1, 40))
def test_pieces_encode_to_the_whole_texts_ids(tokenizers_, text, piece):
    assert "".join(split_for_encoding(text, piece)) == text
    saved, session.PIECE_CHARS = session.PIECE_CHARS, piece
    try:
        for tok in tokenizers_:
            codec = _codec(tok)
            assert codec.text_ids(text) == _plain(codec, text)
    finally:
        session.PIECE_CHARS = saved


def test_a_long_text_is_cut_before_spaces_between_letters():
    text = " ".join(["word"] * 2000)
    pieces = split_for_encoding(text, piece=1000)
    assert len(pieces) > 3 and "".join(pieces) == text
    assert all(p.startswith(" w") for p in pieces[1:])
    assert split_for_encoding("x" * 5000, piece=1000) == ["x" * 5000]   # nowhere to cut
