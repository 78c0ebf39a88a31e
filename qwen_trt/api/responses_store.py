"""The responses ``qwen-trt serve`` keeps for ``previous_response_id``, ``GET
/v1/responses/{id}`` and ``/input_items``: in memory, bounded by count and by bytes, the least
recently used dropped first (``--responses-store-max``, ``--responses-store-mb``; off with
``--no-responses-store``).

Each entry holds its conversation whole (the items of every earlier turn, this turn's input
and its output: function calls and their outputs included), so a response answers for its
chain even after the earlier responses in it were evicted. Later turns share the earlier
items' objects, but each entry is charged the size of its whole conversation, so the bound
holds whatever was evicted. An entry larger than the whole bound is not kept.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass


def size_of(obj) -> int:
    """Bytes of ``obj`` as compact JSON (what an entry is charged)."""
    return len(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass"))


@dataclass(frozen=True)
class Stored:
    """One kept response."""

    response: dict                   # the response object, as sent
    input_items: tuple[dict, ...]    # this request's input items, with their ids
    history: tuple[dict, ...]        # the conversation after it (no instructions)
    history_bytes: int               # size_of each item of history, summed

    @property
    def size(self) -> int:
        return self.history_bytes + size_of(self.response) + size_of(list(self.input_items))


class ResponseStore:
    """At most ``max_count`` responses of at most ``max_bytes`` in all (touched from the event
    loop only)."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._d: OrderedDict[str, tuple[Stored, int]] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, rid: str) -> bool:
        return rid in self._d

    def get(self, rid: str) -> Stored | None:
        got = self._d.get(rid)
        if got is None:
            return None
        self._d.move_to_end(rid)
        return got[0]

    def put(self, rid: str, entry: Stored) -> bool:
        """Keep ``entry`` (the least recently used go when over a bound); False when it alone
        is over the bytes bound (then it is not kept)."""
        size = entry.size
        self.delete(rid)
        if size > self.max_bytes:
            return False
        self._d[rid] = (entry, size)
        self.bytes += size
        while len(self._d) > self.max_count or self.bytes > self.max_bytes:
            _, (_, gone) = self._d.popitem(last=False)
            self.bytes -= gone
            self.evicted += 1
        return True

    def delete(self, rid: str) -> bool:
        got = self._d.pop(rid, None)
        if got is None:
            return False
        self.bytes -= got[1]
        return True
