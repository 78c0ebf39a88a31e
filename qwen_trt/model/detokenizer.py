"""Incremental detokenizer: a growing list of token ids in, text deltas out.

Invariant (tested): ``"".join(deltas) + final_flush == tokenizer.decode(ids, skip_special_tokens=True)``,
and no delta ends inside a multi-byte character. Byte-level BPE splits one Chinese character
or emoji over several tokens; decoding such a prefix ends in U+FFFD, so that last character is
held back until the next token completes it.

Only the *last* U+FFFD can still change: UTF-8 decoders replace an incomplete trailing sequence
with a single U+FFFD, and bytes already followed by other bytes are settled. So everything
before it is emitted at once, which keeps a model that emits invalid bytes streaming too.

Each step decodes only a short window (the ids since the last clean boundary plus the previous
window as context for the decoder), so the cost per token stays flat with reply length.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # A fast tokenizer's decode is its Rust tokenizer's (then an optional clean-up we turn
        # off): called directly, without transformers' wrapper (half the cost of a step's two
        # decodes on the serving loop)
        rust = getattr(tokenizer, "backend_tokenizer", None)
        self._rust = rust if callable(getattr(rust, "decode", None)) else None
        self.ids: list[int] = []
        self._prefix_offset = 0   # window start: context for the decoder
        self._read_offset = 0     # ids before this are fully emitted
        self._held = 0            # chars after read_offset already emitted
        self.text = ""            # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        if self._rust is not None:
            return self._rust.decode(ids, skip_special_tokens=self._skip)
        return self._tok.decode(ids, skip_special_tokens=self._skip,
                                clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token id; return the new text that is safe to show (may be "")."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if not full.startswith(prefix):  # decoder context effect: wait for more tokens
            return ""
        new = full[len(prefix):]
        pending = new.endswith(REPLACEMENT)
        safe = new[:-1] if pending else new
        delta = safe[self._held:] if len(safe) > self._held else ""
        self._held = max(self._held, len(safe))
        if not pending:  # clean character boundary: slide the window
            self._prefix_offset, self._read_offset, self._held = self._read_offset, len(self.ids), 0
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: return whatever is still held back (even a lone U+FFFD)."""
        full = self._decode(self.ids)
        if not full.startswith(self.text):  # never expected; keep the invariant visible
            raise AssertionError("incremental decode diverged from the full decode")
        delta = full[len(self.text):]
        self.text = full
        self._prefix_offset = self._read_offset = len(self.ids)
        self._held = 0
        return delta
