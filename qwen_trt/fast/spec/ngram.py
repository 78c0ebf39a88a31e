"""Prompt lookup (placeholder until the full module lands)."""
from __future__ import annotations


class NgramIndex:
    def __init__(self, n_max: int = 5, n_min: int = 2) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}   # n-gram -> the position after its latest end

    def extend(self, new) -> None:
        for t in new:
            # index the n-grams ending at the current last token before appending the next
            end = len(self.tokens)
            for n in range(self.n_min, self.n_max + 1):
                if end >= n:
                    self.last[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(int(t))

    def propose(self, k: int) -> list[int]:
        toks = self.tokens
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(toks) < n:
                continue
            at = self.last.get(tuple(toks[-n:]))
            if at is not None:   # what followed; past the end, the match's period repeats
                seq = toks[at:at + k]
                period = len(toks) - at
                while len(seq) < k:
                    seq.append(seq[len(seq) - period] if len(seq) >= period else
                               toks[at + len(seq)])
                return seq
        return []
