"""Messages -> prompt ids for ``qwen-trt serve``, without a lock and without redoing work.

:func:`qwen_trt.api.prompt.encode_messages` does the encoding (the chat template's layout, every
content as plain text). This wraps it for a server that sees the same conversations again and
again, one turn longer each time:

* the layout the template renders is cached by its inputs (the messages' roles with
  placeholder contents, and the template options), so Jinja runs once per conversation shape;
* each stretch of text between control tokens is cached (bounded LRU), so turn N re-encodes
  only what is new since turn N-1;
* an assistant message whose text is a reply this server sent recently reuses the token ids the
  engine generated for it (:meth:`remember`): the next prompt then extends the previous prompt +
  reply exactly, which is what the engine's prefix cache matches.

Thread-safe without a global lock: the fast tokenizer's text encoder is a private copy that is
only read (``qwen_trt.serving.session._Codec``), and the caches are dicts guarded by a small lock
held only for a lookup or an insert.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

from qwen_trt.api.prompt import encode_messages
from qwen_trt.serving.session import MessageEncoder

TEXT_CACHE = 4096          # stretches of text kept
TEXT_CACHE_IDS = 1 << 21   # ... holding at most this many token ids in all
LAYOUT_CACHE = 512         # template layouts kept
REPLY_CACHE = 2048         # recent replies kept (text -> generated ids)
QUICK_CHARS = 16384        # below this much content, encode on the event loop (no thread hop)


class _LRU:
    """At most ``size`` entries (and, with ``max_weight``, values of at most that total
    ``len``)."""

    def __init__(self, size: int, max_weight: int | None = None) -> None:
        self._d: OrderedDict = OrderedDict()
        self._size = size
        self._max_weight = max_weight
        self._weight = 0
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
            return v

    def put(self, key, value) -> None:
        weigh = self._max_weight is not None
        if weigh and len(value) > self._max_weight:
            return
        with self._lock:
            old = self._d.pop(key, None)
            if weigh:
                self._weight += len(value) - (len(old) if old is not None else 0)
            self._d[key] = value
            while len(self._d) > self._size or (weigh and self._weight > self._max_weight):
                _, gone = self._d.popitem(last=False)
                if weigh:
                    self._weight -= len(gone)

    def __len__(self) -> int:
        return len(self._d)


class _CachingTokenizer:
    """The tokenizer, with its chat-template rendering (text out) cached by its inputs."""

    def __init__(self, tokenizer, layouts: _LRU) -> None:
        self._tok = tokenizer
        self._layouts = layouts

    def apply_chat_template(self, conversation, tokenize=True, **kw):
        if tokenize:
            return self._tok.apply_chat_template(conversation, tokenize=tokenize, **kw)
        try:
            key = json.dumps([conversation, kw], sort_keys=True, default=repr)
        except (TypeError, ValueError):
            return self._tok.apply_chat_template(conversation, tokenize=False, **kw)
        out = self._layouts.get(key)
        if out is None:
            out = self._tok.apply_chat_template(conversation, tokenize=False, **kw)
            self._layouts.put(key, out)
        return out

    def __getattr__(self, name):
        return getattr(self._tok, name)


class _CachedEncoder(MessageEncoder):
    """:class:`MessageEncoder` whose text stretches come from a shared LRU."""

    def __init__(self, tokenizer, texts: _LRU) -> None:
        super().__init__(tokenizer)
        self._texts = texts

    def _text(self, text: str) -> list[int]:
        ids = self._texts.get(text)
        if ids is None:
            ids = tuple(self._codec.text_ids(text))
            self._texts.put(text, ids)
        return list(ids)

    def _text_within(self, text: str, room: int) -> list[int] | int:
        ids = self._texts.get(text)
        if ids is None:
            got = self._codec.ids_within(text, room)
            if not isinstance(got, int):
                self._texts.put(text, tuple(got))
            return got
        return len(ids) if len(ids) > room else list(ids)


class PromptEncoder:
    """The server's encoder (module docstring); ``encode`` raises ``ApiError`` (400) as
    :func:`~qwen_trt.api.prompt.encode_messages` does."""

    def __init__(self, tokenizer) -> None:
        self.reset(tokenizer)

    def reset(self, tokenizer) -> None:
        """Start over for ``tokenizer`` (the engine came back with another one)."""
        self.tokenizer = tokenizer
        self._layouts = _LRU(LAYOUT_CACHE)
        self._texts = _LRU(TEXT_CACHE, TEXT_CACHE_IDS)
        self._replies = _LRU(REPLY_CACHE)
        self._tok = _CachingTokenizer(tokenizer, self._layouts) if tokenizer is not None else None
        self._encoder = _CachedEncoder(self._tok, self._texts) if tokenizer is not None else None

    @staticmethod
    def quick(messages: Sequence[dict]) -> bool:
        """Whether encoding is short enough to run on the event loop."""
        n = 0
        for m in messages:
            c = m.get("content")
            n += len(c) if isinstance(c, str) else sum(len(str(p)) for p in c or ())
        return n <= QUICK_CHARS

    def encode(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
               limit: int | None = None) -> list[int]:
        msgs = []
        for m in messages:
            m = dict(m)
            if m["role"] == "assistant" and isinstance(m["content"], str):
                ids = self._replies.get(m["content"])
                if ids is not None:
                    m["token_ids"] = ids
            msgs.append(m)
        return encode_messages(self.tokenizer, msgs, tools, limit=limit, encoder=self._encoder)

    def remember(self, text: str, token_ids: Sequence[int]) -> None:
        """``text`` was sent as a whole reply and the engine generated exactly ``token_ids``
        for it (no stop string cut it short)."""
        if text and token_ids:
            self._replies.put(text, tuple(token_ids))
