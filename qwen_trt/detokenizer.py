"""Incremental detokenizer: a growing list of token ids in, text deltas out.

Invariant (tested): ``"".join(deltas) + final_flush == tokenizer.decode(ids, skip_special_tokens=True)``,
and no delta ends inside a multi-byte character. Byte-level BPE splits one Chinese character
or emoji over several tokens; decoding such a prefix ends in U+FFFD, so that text is held back
until the next token completes the character.

Each step decodes only a short window (the ids since the last emitted boundary plus a little
context before it), so the cost per token stays flat with reply length.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0   # window start (context for the decoder)
        self._read_offset = 0     # ids before this are fully emitted
        self.text = ""            # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip,
                                clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token id; return the new text that is safe to show (may be "")."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT) and full.startswith(prefix):
            delta = full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of the stream: return whatever is still held back (even a lone U+FFFD)."""
        full = self._decode(self.ids)
        if not full.startswith(self.text):  # never expected; keep the invariant visible
            raise AssertionError("incremental decode diverged from the full decode")
        delta = full[len(self.text):]
        self.text = full
        self._prefix_offset = self._read_offset = len(self.ids)
        return delta
