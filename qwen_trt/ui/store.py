"""Chats that survive a page reload: a bounded, expiring store in the app process.

A browser session's conversation lives in ``st.session_state``, which a reload throws away.
The app keeps a copy (a plain-data snapshot, see :meth:`ChatState.snapshot`) here, keyed by a
session id it puts in the page URL (``?chat=<id>``). The id is ``secrets.token_urlsafe`` (128
bits): knowing it is what gives access to the chat, so it is never derived from anything and
an id the store does not know is never adopted (a new one is issued instead, so nobody can plant
an id on someone else's URL).

Two tabs can show one chat (the same URL). Each saved chat has a version, and a tab saves on
top of the version it has: when another tab saved in between, :meth:`SessionStore.save` keeps
both instead of overwriting, writing this tab's conversation as a new chat (a fork) that the
original lists under ``"forks"`` and that names the original under ``"forked_from"``.

Bounded on both axes: at most ``max_chats`` chats (least recently used dropped first) and each
expires ``ttl_s`` after its last use. Memory only: a server restart forgets every chat, and
behind a load balancer a reload finds its chat only with sticky routing to the same process.
"""
from __future__ import annotations

import copy
import json
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from qwen_trt import settings

DEFAULT_MAX_CHATS = 256
DEFAULT_TTL_S = 6 * 3600.0
ID_BYTES = 16
QUERY_KEY = "chat"
MAX_FORKS = 8          # forks an original chat lists (the newest)


def new_session_id() -> str:
    return secrets.token_urlsafe(ID_BYTES)


def looks_like_session_id(value: object) -> bool:
    """Cheap shape check before a lookup (URL-safe base64 of ID_BYTES bytes)."""
    return (isinstance(value, str) and len(value) == len(new_session_id())
            and all(c.isalnum() or c in "-_" for c in value))


@dataclass(frozen=True)
class Saved:
    """Where a save went: ``sid`` at ``version``; ``forked_from`` is the chat it was meant for
    when that one had changed meanwhile (``sid`` is then a new chat)."""

    sid: str
    version: int
    forked_from: str | None = None


class SessionStore:
    """Thread-safe LRU map ``session id -> snapshot`` with a time to live per entry."""

    def __init__(self, max_chats: int = DEFAULT_MAX_CHATS, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic, seed_dir: str | None = None) -> None:
        if max_chats < 1 or ttl_s <= 0:
            raise ValueError("max_chats must be >= 1 and ttl_s > 0")
        self.max_chats = max_chats
        self.ttl_s = ttl_s
        self._clock = clock
        self.seed_dir = seed_dir
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[float, dict]] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def get(self, sid: str) -> dict | None:
        """The snapshot saved under ``sid`` (a copy), or None if unknown or expired."""
        if not looks_like_session_id(sid):
            return None
        with self._lock:
            self._expire()
            item = self._items.get(sid)
            if item is None:
                seeded = self._seed(sid)
                if seeded is None:
                    return None
                item = (self._clock(), seeded)
            self._items[sid] = (self._clock(), item[1])
            self._items.move_to_end(sid)
            return copy.deepcopy(item[1])

    def put(self, sid: str, snapshot: dict) -> None:
        """Save ``snapshot`` under ``sid`` whatever was there (see :meth:`save` for tabs)."""
        snap = copy.deepcopy(snapshot)
        with self._lock:
            self._put_locked(sid, snap)

    def save(self, sid: str, snapshot: dict, base_version: int) -> Saved:
        """Save ``snapshot`` as the next version of chat ``sid`` if its saved version is still
        ``base_version`` (or it is gone); otherwise another tab saved meanwhile, and the
        snapshot becomes a new chat linked from ``sid`` (see the module docstring)."""
        with self._lock:
            self._expire()
            item = self._items.get(sid)
            current = item[1].get("version", 0) if item is not None else None
            if current is None or current == base_version:
                version = (current or 0) + 1
                keep = {k: item[1][k] for k in ("forks", "forked_from") if k in item[1]} \
                    if item is not None else {}
                self._put_locked(sid, dict(copy.deepcopy(snapshot), **keep, version=version))
                return Saved(sid, version)
            fork = new_session_id()
            original = item[1]
            original["forks"] = (original.get("forks", []) + [fork])[-MAX_FORKS:]
            self._put_locked(fork, dict(copy.deepcopy(snapshot), version=1, forked_from=sid))
            return Saved(fork, 1, forked_from=sid)

    def forks(self, sid: str) -> list[str]:
        """The chats forked from ``sid`` that are still kept (newest last)."""
        with self._lock:
            item = self._items.get(sid)
            if item is None:
                return []
            return [f for f in item[1].get("forks", []) if f in self._items]

    def _put_locked(self, sid: str, snap: dict) -> None:
        self._items[sid] = (self._clock(), snap)
        self._items.move_to_end(sid)
        self._expire()
        while len(self._items) > self.max_chats:
            self._items.popitem(last=False)

    def drop(self, sid: str) -> None:
        with self._lock:
            self._items.pop(sid, None)

    def _seed(self, sid: str) -> dict | None:
        """Benchmarks only (``QWEN_TRT_APP_SEED_DIR``): a chat prepared as ``<dir>/<sid>.json``
        (a snapshot), so a long history can be measured without typing it."""
        if not self.seed_dir:
            return None
        path = os.path.join(self.seed_dir, sid + ".json")
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _expire(self) -> None:
        now = self._clock()
        while self._items:
            sid, (used, _) = next(iter(self._items.items()))
            if now - used < self.ttl_s:
                return
            del self._items[sid]


_STORE: SessionStore | None = None
_STORE_LOCK = threading.Lock()


def process_store() -> SessionStore:
    """The one store of this app process (shared by every browser session)."""
    global _STORE
    with _STORE_LOCK:
        if _STORE is None:
            _STORE = SessionStore(seed_dir=settings.get("QWEN_TRT_APP_SEED_DIR"))
        return _STORE
