"""Streaming to a page at a flat cost: merge token deltas into chunks, render only what changes.

* :func:`coalesce` merges the text deltas that arrive within ``interval_s`` of the last emitted
  chunk into one, so a page re-renders at most ~1/interval_s times a second however fast tokens
  come (the first delta is emitted at once, so time to first token is not delayed).
* :class:`StreamView` splits the growing reply into Markdown blocks that are final (rendered
  once) and the open tail (re-rendered with a cursor on each chunk).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from qwen_trt.serving.events import Delta, Event, Waiting
from qwen_trt.ui.text import CURSOR, markdown_html, render_html, stable_prefix_end

DEFAULT_INTERVAL_S = 0.03
# Turns drawn on every rerun; older ones wait behind a "Show earlier turns" button, so the
# work per message (and the time to the first token on screen) does not grow with the chat.
HISTORY_WINDOW = 20


def hidden_turns(total: int, show_all: bool, window: int = HISTORY_WINDOW) -> int:
    """How many of the oldest ``total`` turns to leave out of the page."""
    return 0 if show_all else max(0, total - window)


def coalesce(events: Iterable[Event], interval_s: float = DEFAULT_INTERVAL_S,
             clock: Callable[[], float] = time.monotonic) -> Iterator[Event]:
    """Yield ``events`` with consecutive :class:`Delta` texts merged.

    A merged chunk is emitted when ``interval_s`` has passed since the previous chunk, and
    before any other event (a :class:`Waiting` heartbeat flushes text that is due, so nothing
    lags more than about one poll period behind the engine).
    """
    buf: list[str] = []
    last: float | None = None

    def flush() -> Iterator[Event]:
        nonlocal last
        if buf:
            text = "".join(buf)
            buf.clear()
            last = clock()
            yield Delta(text)

    for ev in events:
        if isinstance(ev, Delta):
            buf.append(ev.text)
            if last is None or clock() - last >= interval_s:
                yield from flush()
            continue
        if isinstance(ev, Waiting):
            if buf and (last is None or clock() - last >= interval_s):
                yield from flush()
            yield ev
            continue
        yield from flush()
        yield ev
    yield from flush()


@dataclass
class StreamUpdate:
    """What to draw for one chunk: blocks that just became final, and the new tail."""

    new_blocks: list[str]     # safe HTML (text.markdown_html), each drawn once, in order
    tail: str                 # safe HTML of the open block, cursor included


@dataclass
class StreamView:
    """Tracks a growing reply and says what to re-render."""

    text: str = ""
    frozen: int = 0                      # text[:frozen] is already rendered as final blocks
    cursor: str = CURSOR
    _blocks: list[str] = field(default_factory=list)

    def add(self, delta: str) -> StreamUpdate:
        self.text += delta
        # text[:frozen] ends outside any fence at a block start, so only the rest needs a scan
        # (keeps each chunk's cost independent of the reply's length)
        end = self.frozen + stable_prefix_end(self.text[self.frozen:])
        new: list[str] = []
        if end > self.frozen:
            new.append(markdown_html(self.text[self.frozen:end]))
            self.frozen = end
        # the cursor goes in before sanitising, so it is drawn where the text ends (inside an
        # open code block, for one); the tail changes on every chunk: not worth caching
        tail = self.text[self.frozen:] + self.cursor
        return StreamUpdate(new_blocks=new, tail=render_html(tail))
