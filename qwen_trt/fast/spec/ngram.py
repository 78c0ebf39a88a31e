"""Draft-free proposals by n-gram / prompt lookup: the next tokens after the most recent earlier
occurrence of the sequence's last ``n`` tokens (prompt + reply so far), longest ``n`` first
(``n_max`` down to ``n_min``). No draft model; a deterministic draft, so the verify step accepts
it with ``q`` one-hot (:func:`qwen_trt.fast.spec.rejection.accept` with ``q=None``).

One :class:`NgramIndex` per request, fed incrementally (``prompt=`` or :meth:`NgramIndex.extend`
with the prompt, then with the tokens each step emitted), :meth:`NgramIndex.propose` for the
next step's drafts; ``reply_len`` counts what came after ``prompt``. Each n-gram is
packed into one Python int (``TOKEN_BITS`` bits per token: exact, no hash collisions) and a
dict per ``n`` maps it to the position after its latest occurrence, so ``extend`` costs
``O(n_max)`` per token and ``propose`` one dict lookup per ``n`` tried plus ``O(k)`` to copy.
The longest match is found by growing ``n`` from ``n_min`` (if the last ``n + 1`` tokens occurred
before, so did the last ``n``), so a sequence with no repeat costs a single lookup.

``prediction``: a fixed text's tokens (OpenAI's "predicted outputs"): while the reply follows it
the proposal is its next ``k`` tokens; after a divergence the reply's last tokens are looked up
in it as in the history (a match at least as long as the history's wins).

``shared``: a :class:`RecentReplies` index over the replies of earlier requests (bounded: two
generations of at most ``max_tokens / 2`` tokens each, the older dropped whole), consulted when
it matches longer than the request's own history and the prediction.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

TOKEN_BITS = 20          # token ids below 2**20 (Qwen3's vocabulary is 151,936)
TOKEN_MAX = (1 << TOKEN_BITS) - 1


@dataclass(frozen=True)
class NgramSettings:
    """How the lookup matches: the last ``n`` tokens for ``n`` from ``n_max`` down to ``n_min``."""

    n_max: int = 5
    n_min: int = 2

    def __post_init__(self) -> None:
        if type(self.n_min) is not int or type(self.n_max) is not int \
                or not 1 <= self.n_min <= self.n_max <= 16:
            raise ValueError(f"n-gram sizes must satisfy 1 <= n_min <= n_max <= 16, got "
                             f"n_min={self.n_min!r}, n_max={self.n_max!r}")


class _Table:
    """n-gram -> position after its latest occurrence, for ``n`` in ``n_min..n_max``, over a
    token list that only grows (the request's, or a fixed prediction)."""

    __slots__ = ("tokens", "pairs", "packed", "n_min", "n_max", "top")

    def __init__(self, settings: NgramSettings) -> None:
        self.tokens: list[int] = []
        self.n_min, self.n_max = settings.n_min, settings.n_max
        # (table, mask) of each n, shortest first
        self.pairs = [({}, (1 << (TOKEN_BITS * n)) - 1)
                      for n in range(self.n_min, self.n_max + 1)]
        self.top = (1 << (TOKEN_BITS * self.n_max)) - 1
        self.packed = 0            # the last n_max tokens, one per TOKEN_BITS bits

    def extend(self, new: Sequence[int]) -> None:
        toks, pairs, top, n_min, n_max = self.tokens, self.pairs, self.top, self.n_min, self.n_max
        packed, n = self.packed, len(toks)
        for t in new:
            if type(t) is not int:           # numpy / torch integers would overflow the packing
                t = operator.index(t)
            if not 0 <= t <= TOKEN_MAX:
                self.packed = packed
                raise ValueError(f"token id {t!r} is outside 0..2**{TOKEN_BITS}-1")
            # the n-grams ending at the last token get this token as their continuation
            if n >= n_max:
                for table, mask in pairs:
                    table[packed & mask] = n
            else:
                for size, (table, mask) in enumerate(pairs, n_min):
                    if size <= n:
                        table[packed & mask] = n
            packed = ((packed << TOKEN_BITS) | t) & top
            toks.append(t)
            n += 1
        self.packed = packed

    def match(self, packed: int, limit: int = 1 << 30) -> tuple[int, int]:
        """``(n, position)`` of the longest n-gram (``n <= limit``) of ``packed`` (the last
        tokens of some sequence, packed; fewer than ``n_max`` are padded with zero bits, which
        in the sequence's own table match nothing longer than what was seen) seen in this
        table; ``(0, -1)`` when none."""
        best_n, best = 0, -1
        for size, (table, mask) in enumerate(self.pairs, self.n_min):
            if size > limit:
                break
            pos = table.get(packed & mask)
            if pos is None:
                break
            best_n, best = size, pos
        return best_n, best


SEPARATOR = (1 << TOKEN_BITS) - 1     # between replies in RecentReplies; no real token id


class RecentReplies:
    """n-grams of recent replies, shared by every request's :class:`NgramIndex`. Replies are
    appended to the current generation (one token list, replies apart by :data:`SEPARATOR`);
    when it holds ``max_tokens / 2`` tokens it becomes the previous one and the one before is
    dropped, so memory stays bounded and eviction costs nothing per token."""

    __slots__ = ("settings", "max_tokens", "_gens")

    def __init__(self, settings: NgramSettings = NgramSettings(), max_tokens: int = 1 << 16
                 ) -> None:
        if type(max_tokens) is not int or max_tokens < 2:
            raise ValueError(f"max_tokens must be a whole number >= 2, got {max_tokens!r}")
        self.settings, self.max_tokens = settings, max_tokens
        self._gens = [_Table(settings)]            # newest first

    def add(self, reply: Sequence[int]) -> None:
        """Index a finished reply (its token ids)."""
        if not reply:
            return
        if SEPARATOR in reply:
            raise ValueError(f"token id {SEPARATOR} is reserved")
        cur = self._gens[0]
        if len(cur.tokens) >= self.max_tokens // 2:
            cur = _Table(self.settings)
            self._gens = [cur, self._gens[0]]
        cur.extend([*reply, SEPARATOR])

    @property
    def tokens(self) -> int:
        """Tokens held now (separators included)."""
        return sum(len(g.tokens) for g in self._gens)

    def match(self, packed: int, limit: int) -> tuple[int, list[int], int]:
        """``(n, tokens, position)`` of the longest match (``n <= limit``, the tokens the
        asking sequence has) of ``packed``, the newest generation first on ties;
        ``(0, [], -1)`` when none."""
        best = (0, [], -1)
        for gen in self._gens:
            n, pos = gen.match(packed, limit)
            if n > best[0]:
                best = (n, gen.tokens, pos)
        return best

    def continuation(self, packed: int, limit: int, k: int, longer_than: int) -> list[int]:
        """Up to ``k`` tokens after the longest match, if it is longer than ``longer_than``
        tokens, stopping at the end of that reply."""
        n, toks, pos = self.match(packed, limit)
        if n <= longer_than:
            return []
        out = toks[pos:pos + k]
        return out[:out.index(SEPARATOR)] if SEPARATOR in out else out


def _copy(tokens: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens from ``start`` on; past the end the copy continues from itself (a repeating
    pattern keeps repeating), as LZ77 copies do."""
    out = tokens[start:start + k]
    end = len(tokens)
    while len(out) < k and start + len(out) >= end:
        out.append(out[start + len(out) - end])
    return out


class NgramIndex:
    """The lookup proposer of one request (module docstring). With a ``prediction``, give the
    prompt as ``prompt=``: every token extended afterwards is reply, followed through the
    prediction from its start."""

    __slots__ = ("settings", "_seq", "_reply_start", "_pred", "_pred_pos", "_shared")

    def __init__(self, n_max: int = NgramSettings.n_max, n_min: int = NgramSettings.n_min, *,
                 prompt: Sequence[int] = (), prediction: Sequence[int] | None = None,
                 shared: RecentReplies | None = None) -> None:
        self.settings = settings = NgramSettings(n_max=n_max, n_min=n_min)
        if shared is not None and shared.settings != settings:
            raise ValueError(f"the shared replies index matches n = {shared.settings.n_min}.."
                             f"{shared.settings.n_max}, this one {n_min}..{n_max}")
        self._shared = shared
        self._seq = _Table(settings)
        self._seq.extend(prompt)
        self._reply_start = len(self._seq.tokens)
        self._pred: _Table | None = None
        self._pred_pos: int | None = None      # where the reply stands in the prediction
        if prediction:
            self._pred = _Table(settings)
            self._pred.extend(prediction)
            self._pred_pos = 0

    @property
    def tokens(self) -> list[int]:
        """Every token so far (prompt, then reply); do not modify."""
        return self._seq.tokens

    @property
    def reply_len(self) -> int:
        return len(self._seq.tokens) - self._reply_start

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append the tokens a step emitted (accepted drafts and the token drawn after them)."""
        if self._pred_pos is not None:
            pred = self._pred.tokens
            end = self._pred_pos + len(new_tokens)
            same = end <= len(pred) and pred[self._pred_pos:end] == list(new_tokens)
            self._pred_pos = end if same else None
        self._seq.extend(new_tokens)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens (possibly none)."""
        if k <= 0:
            return []
        if self._pred is not None or self._shared is not None:
            return self._propose_general(k)
        seq = self._seq
        packed, best = seq.packed, -1
        for table, mask in seq.pairs:          # seq.match, inlined: this runs every step
            pos = table.get(packed & mask)
            if pos is None:
                break
            best = pos
        if best < 0:
            return []
        out = seq.tokens[best:best + k]
        return out if len(out) == k else _copy(seq.tokens, best, k)

    def _propose_general(self, k: int) -> list[int]:
        pred, seq = self._pred, self._seq
        if self._pred_pos is not None and self._pred_pos < len(pred.tokens):
            return pred.tokens[self._pred_pos:self._pred_pos + k]
        n_pred, at = pred.match(seq.packed, len(seq.tokens)) if pred is not None else (0, -1)
        n, pos = seq.match(seq.packed)
        if self._shared is not None:
            out = self._shared.continuation(seq.packed, len(seq.tokens), k, max(n, n_pred))
            if out:
                return out
        if n_pred and n_pred >= n:
            self._pred_pos = at
            return pred.tokens[at:at + k]
        return _copy(seq.tokens, pos, k) if n else []
