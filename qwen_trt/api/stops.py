"""Stop strings over a stream of text deltas: stop when the text contains one, and never send
any part of it (the text that could still grow into a stop string is held back)."""
from __future__ import annotations

from collections.abc import Sequence


class StopScanner:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0           # text[:sent] has been handed out
        self.stopped = False
        self.matched: str | None = None     # the stop string found

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the text that is now safe to send. Sets :attr:`stopped` (and
        trims there) once a stop string appears."""
        if self.stopped:
            return ""
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        # No stop string can begin before `sent`: the held-back tail was searched each time.
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            self.matched = next(s for s in self.stops if self.text.find(s, self.sent) == cut)
            out = self.text[self.sent:cut]
            self.text, self.sent, self.stopped = self.text[:cut], cut, True
            return out
        safe = len(self.text) - self.hold
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def flush(self) -> str:
        """At the end of the reply: what was held back."""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
