"""Log-probabilities on the wire, from the engine's :class:`~qwen_trt.params.TokenLogprob` per
generated token (``Delta.logprobs``).

The engine computes them per row on the device: the log-softmax of the logits after the
penalties and the grammar mask, before temperature and top-k / top-p (so they describe the
model's distribution, not the sampler's). Here they are only rendered:

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``;
* completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.

A token's text is its own bytes decoded (a token holding part of a multi-byte character shows
U+FFFD; ``bytes`` has the exact bytes). ``-inf`` (a token the grammar forbids) is sent as
-9999.0, as JSON has no infinity.
"""
from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence

from qwen_trt.params import TokenLogprob

FLOOR = -9999.0


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (printable stand-ins for the 256 bytes), reversed."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return {c: b for b, c in enumerate(chars)}


_BYTES = _byte_decoder()


class TokenTexts:
    """Per tokenizer: each token id's bytes (cached)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {int(i): str(t) for i, t in added.items()}
        self._cache: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def bytes(self, token_id: int) -> bytes:
        got = self._cache.get(token_id)
        if got is not None:
            return got
        if token_id in self._added:
            got = self._added[token_id].encode()
        else:
            with self._lock:
                piece = self._tok.convert_ids_to_tokens(int(token_id))
            if isinstance(piece, str) and piece and all(c in _BYTES for c in piece):
                got = bytes(_BYTES[c] for c in piece)
            else:             # not byte-level BPE: the decoded text
                with self._lock:
                    got = self._tok.decode([int(token_id)]).encode()
        self._cache[token_id] = got
        return got

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", "replace")


_TEXTS: "weakref.WeakKeyDictionary[object, TokenTexts]" = weakref.WeakKeyDictionary()


def token_texts(tokenizer) -> TokenTexts:
    try:
        got = _TEXTS.get(tokenizer)
        if got is None:
            got = _TEXTS[tokenizer] = TokenTexts(tokenizer)
        return got
    except TypeError:
        return TokenTexts(tokenizer)


def _lp(value: float) -> float:
    return FLOOR if math.isnan(value) or value < FLOOR else float(value)


def chat_entries(texts: TokenTexts, logprobs: Sequence[TokenLogprob], top: int) -> list[dict]:
    """``choices[].logprobs.content`` entries of a chat completion, ``top`` alternatives each."""
    out = []
    for lp in logprobs:
        raw = texts.bytes(lp.token_id)
        out.append({"token": raw.decode("utf-8", "replace"), "logprob": _lp(lp.logprob),
                    "bytes": list(raw),
                    "top_logprobs": [{"token": texts.text(t), "logprob": _lp(v),
                                      "bytes": list(texts.bytes(t))}
                                     for t, v in lp.top[:top]]})
    return out


class CompletionLogprobs:
    """The legacy ``logprobs`` object of ``/v1/completions``, built up as tokens arrive."""

    def __init__(self, texts: TokenTexts, top: int, offset: int = 0) -> None:
        self._texts = texts
        self._top = top
        self.offset = offset             # text_offset of the next token

    def render(self, logprobs: Sequence[TokenLogprob]) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for lp in logprobs:
            text = self._texts.text(lp.token_id)
            tokens.append(text)
            values.append(_lp(lp.logprob))
            offsets.append(self.offset)
            self.offset += len(text)
            alts: dict[str, float] = {}
            for t, v in lp.top[:self._top]:
                alts.setdefault(self._texts.text(t), _lp(v))
            tops.append(alts)
        return {"tokens": tokens, "token_logprobs": values,
                "top_logprobs": tops, "text_offset": offsets}
