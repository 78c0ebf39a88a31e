"""Chats that survive a page reload: a bounded, expiring store in the app process.

A browser session's conversation lives in ``st.session_state``, which a reload throws away.
The app keeps a copy (a plain-data snapshot, see :meth:`ChatState.snapshot`) here, keyed by a
session id it puts in the page URL (``?chat=<id>``). The id is ``secrets.token_urlsafe`` (128
bits): knowing it is what gives access to the chat, so it is never derived from anything and
an id the store does not know is never adopted (a new one is issued instead, so nobody can plant
an id on someone else's URL).

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

from qwen_trt import settings

DEFAULT_MAX_CHATS = 256
DEFAULT_TTL_S = 6 * 3600.0
ID_BYTES = 16
QUERY_KEY = "chat"


def new_session_id() -> str:
    return secrets.token_urlsafe(ID_BYTES)


def looks_like_session_id(value: object) -> bool:
    """Cheap shape check before a lookup (URL-safe base64 of ID_BYTES bytes)."""
    return (isinstance(value, str) and len(value) == len(new_session_id())
            and all(c.isalnum() or c in "-_" for c in value))


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
        snap = copy.deepcopy(snapshot)
        with self._lock:
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
            _STORE = SessionStore(seed_dir=settings.raw("QWEN_TRT_APP_SEED_DIR"))
        return _STORE
