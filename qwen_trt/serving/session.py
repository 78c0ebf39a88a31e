"""A multi-turn conversation and the prompt that fits the engine's input limit.

History is kept whole (nothing the user sees is lost); each prompt uses the newest turns that
fit. Oldest whole turns (a user message and its reply) are dropped first; the system prompt and
the newest user message are never dropped; a turn is never split.

Prompts are built by :func:`encode_messages`, the one place every front end (app, CLI, HTTP
API) turns chat messages into ids: the layout comes from the tokenizer's own chat template,
message contents are always tokenised as plain text (a message that spells ``<|im_start|>``
cannot forge a turn), and an earlier reply reuses the ids the engine generated for it, so the
next prompt starts with exactly the ids already in the engine's KV cache.
"""
from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from qwen_trt.errors import EmptyMessageError, InvalidMessageError, PromptTooLongError, first_line
from qwen_trt.params import prompt_budget

Role = Literal["system", "user", "assistant", "tool"]

# Stands in for message i while the template is rendered (private-use characters: no template
# or tokenizer gives them a meaning).
_SLOT = "\ue000{}\ue001"
_SLOT_RE = re.compile("\ue000(\\d+)\ue001")
# Stands in for control token k inside tools / tool calls while the template is rendered.
_SHIELD = "\ue002{}\ue003"
_SHIELD_RE = re.compile("\ue002(\\d+)\ue003")


@dataclass
class Message:
    role: Role
    content: str
    interrupted: bool = False   # an assistant reply cut short by the user
    token_ids: list[int] | None = None   # an assistant reply: the ids the engine generated

    def as_template_dict(self) -> dict:
        d = {"role": self.role, "content": self.content}
        if self.token_ids:
            d["token_ids"] = self.token_ids
        return d


@dataclass
class PromptPlan:
    """What will be sent to the backend for one new user message."""

    ids: list[int]
    dropped_turns: int          # oldest turns left out of this prompt to fit the limit
    used_turns: int             # history turns included
    token_budget: int           # the prompt limit it was fitted to
    messages: list[dict] = field(default_factory=list)   # the same prompt as chat messages


def render_prompt_text(tokenizer, messages: list[dict]) -> str:
    """The prompt through the tokenizer's own chat template (transformers 4.x and 5.x)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class _Codec:
    """Per tokenizer: its control tokens, and a copy of its backend that encodes them as text.

    Every added token counts: the special ones (``<|im_start|>``) and the others Qwen3 adds
    (``<tool_call>``, ``<tool_response>``, ``<think>``, ...), which the real tokenizer would
    otherwise match inside any text. transformers' ``split_special_tokens=True`` flips a flag
    on the shared backend tokenizer for the call, which another thread encoding at the same
    moment would see (a race that turns text into control tokens). A private copy with every
    added token marked special and the flag set for good has no such window.
    """

    def __init__(self, tokenizer) -> None:
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.controls = {str(t): int(i) for i, t in added.items()}
        self.control_ids = frozenset(self.controls.values())
        names = sorted(self.controls, key=len, reverse=True)
        self.names = names
        self.split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            import json

            from tokenizers import Tokenizer

            data = json.loads(backend.to_str())
            for tok in data.get("added_tokens") or ():
                tok["special"] = True
            copy = Tokenizer.from_str(json.dumps(data))
            copy.encode_special_tokens = True
            # encode_batch(_fast) works with the GIL released (encode holds it for the whole
            # text), so a long text does not stall the other threads; the ids stay in Rust until
            # asked for. The fast form skips the offsets (unused here): a third of the time, and
            # its encoding is freed at once (freeing the offsets of millions of tokens takes
            # about a second, with the GIL held).
            batch = getattr(copy, "encode_batch_fast", copy.encode_batch)
            self._encoding = lambda text: batch([text], add_special_tokens=False)[0]
            self._encode = lambda text: self._encoding(text).ids
        else:  # a slow (Python) tokenizer: its own option, one call at a time
            lock = threading.Lock()

            def encode(text: str) -> list[int]:
                with lock:
                    return tokenizer(text, add_special_tokens=False,
                                     split_special_tokens=True)["input_ids"]
            self._encode = encode
            self._encoding = encode

    def shield(self, obj):
        """``obj`` (tools, tool calls: JSON-like data the template prints) with each control
        token's text replaced by a private-use stand-in, so the rendered layout holds no
        marker the template did not write itself; :meth:`unshield` restores the text."""
        if isinstance(obj, str):
            if self.split is None:
                return obj
            return self.split.sub(lambda m: _SHIELD.format(self.names.index(m.group(0))), obj)
        if isinstance(obj, dict):
            return {self.shield(k): self.shield(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.shield(v) for v in obj]
        return obj

    def unshield(self, text: str) -> str:
        if "\ue002" not in text:
            return text

        def back(m):
            i = int(m.group(1))
            return self.names[i] if i < len(self.names) else m.group(0)
        return _SHIELD_RE.sub(back, text)

    def text_ids(self, text: str) -> list[int]:
        return list(self._encode(text)) if text else []

    def ids_within(self, text: str, room: int) -> list[int] | int:
        """The ids of ``text``, or only their number when there are more than ``room``."""
        if not text:
            return []
        enc = self._encoding(text)
        return len(enc) if len(enc) > room else list(enc.ids if hasattr(enc, "ids") else enc)


class PromptTokensError(PromptTooLongError):
    """The messages come to more tokens than the limit given (``tokens``: how many)."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"The messages come to {tokens} tokens; the limit is {limit}.")
        self.tokens = tokens
        self.limit = limit


_CODECS: "weakref.WeakKeyDictionary[object, _Codec]" = weakref.WeakKeyDictionary()
_CODECS_LOCK = threading.Lock()


def _codec(tokenizer) -> _Codec:
    with _CODECS_LOCK:
        try:
            codec = _CODECS.get(tokenizer)
            if codec is None:
                codec = _CODECS[tokenizer] = _Codec(tokenizer)
        except TypeError:            # not weakly referenceable / hashable: build one each time
            codec = _Codec(tokenizer)
        return codec


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> tuple[str, bool]:
    """``text`` with what is not valid Unicode text replaced by U+FFFD, and whether anything was.

    Python hands undecodable input bytes over as lone surrogates (``surrogateescape``: command
    line arguments, a terminal in a C locale); JSON may spell them as ``"\\ud800"``. No
    tokenizer takes them.
    """
    if not _SURROGATE.search(text):
        return text, False
    try:
        raw = text.encode("utf-8", "surrogateescape")     # the original bytes, where they were
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace"), True


def _content_text(message, index: int) -> str:
    """A message's content as text: a string, OpenAI's list of text parts, or None (empty)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidMessageError(f"Message {index + 1} must be an object with a 'role'.")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return valid_text(content or "")[0]
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return valid_text("".join(p["text"] for p in content))[0]
    raise InvalidMessageError(f"Message {index + 1} ({message['role']}): the content must be "
                              f"text (a string or a list of text parts).")


def _template_error(e: BaseException) -> bool:
    """Whether ``e`` comes from rendering a chat template (jinja2 raises its own types; a
    template's ``raise_exception`` raises ``TemplateError``)."""
    try:
        import jinja2
    except ImportError:
        return False
    return isinstance(e, jinja2.TemplateError)


class MessageEncoder:
    """Chat messages to prompt ids (see :func:`encode_messages`); with ``cache`` it keeps the
    ids of each stretch of text between control tokens for the next call (a conversation
    re-encodes only what is new; :meth:`keep_used_only` bounds the cache)."""

    def __init__(self, tokenizer, cache: bool = False) -> None:
        self._tok = tokenizer
        self._codec = _codec(tokenizer)
        self._cache: dict[str, list[int]] | None = {} if cache else None
        self._used: dict[str, list[int]] = {}

    def _text(self, text: str) -> list[int]:
        if self._cache is None:
            return self._codec.text_ids(text)
        ids = self._used.get(text)
        if ids is None:
            ids = self._cache.get(text)
            if ids is None:
                ids = self._codec.text_ids(text)
            self._used[text] = ids
        return ids

    def _text_within(self, text: str, room: int) -> list[int] | int:
        """The ids of ``text``, or only their number when there are more than ``room``."""
        return self._codec.ids_within(text, room)

    def keep_used_only(self) -> None:
        if self._cache is not None:
            self._cache, self._used = self._used, {}

    def encode(self, messages: Sequence[dict], add_generation_prompt: bool = True,
               tools: Sequence[dict] | None = None, *, limit: int | None = None) -> list[int]:
        """The prompt ids; with ``limit``, :class:`PromptTokensError` when there are more
        (the ids past the limit are only counted, never built)."""
        codec = self._codec
        texts = [_content_text(m, i) for i, m in enumerate(messages)]
        slots, expected = [], []
        for i, m in enumerate(messages):
            slot = {"role": m["role"], "content": _SLOT.format(i)}
            calls = m.get("tool_calls") if m["role"] == "assistant" else None
            if calls:
                slot["tool_calls"] = codec.shield(list(calls))
                if not texts[i]:
                    slot["content"] = ""   # the template tests the content for emptiness
            if slot["content"]:
                expected.append(i)
            slots.append(slot)
        extra = {"tools": codec.shield(list(tools))} if tools else {}
        try:
            layout = self._tok.apply_chat_template(slots, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt,
                                                   **extra)
        except Exception as e:
            if not _template_error(e):
                raise
            detail = first_line(e, 200) or type(e).__name__
            raise InvalidMessageError(f"The chat template rejected these messages: "
                                      f"{detail}") from e
        found = [int(i) for i in _SLOT_RE.findall(layout)]
        if sorted(found) != expected:
            missing = next((i for i in range(len(messages)) if found.count(i) != (i in expected)),
                           0)
            raise InvalidMessageError(
                f"Message {missing + 1} ({messages[missing]['role']}) does not fit the model's "
                f"chat template (an unknown role, or a message out of place).")
        ids = []
        over = 0     # with a limit: tokens counted once past it

        def add_text(text: str) -> None:
            nonlocal over
            if limit is None:
                ids.extend(self._text(text))
            elif over:
                got = codec.ids_within(text, 0)
                over += got if isinstance(got, int) else len(got)
            else:
                got = self._text_within(text, limit - len(ids))
                if isinstance(got, int):
                    over = got
                else:
                    ids.extend(got)

        def add_ids(more: list[int]) -> None:
            nonlocal over
            if over or (limit is not None and len(ids) + len(more) > limit):
                over += len(more)
            else:
                ids.extend(more)

        for part in (codec.split.split(layout) if codec.split else [layout]):
            if part in codec.controls:            # the template's own markers: control tokens
                add_ids([codec.controls[part]])
                continue
            # A stretch between markers: template text and contents, encoded as text in one go
            # (the tokenizer's own boundaries), except where an earlier reply brings its ids.
            pending, pos = [], 0
            for m in _SLOT_RE.finditer(part):
                i = int(m.group(1))
                pending.append(codec.unshield(part[pos:m.start()]))
                pos = m.end()
                reused = self._generated_ids(messages[i])
                if reused is None:
                    pending.append(texts[i])
                else:
                    add_text("".join(pending))
                    add_ids(reused)
                    pending = []
            pending.append(codec.unshield(part[pos:]))
            add_text("".join(pending))
        if over:
            raise PromptTokensError(len(ids) + over, limit)
        return ids

    def _generated_ids(self, message: dict) -> list[int] | None:
        """An assistant message's generated ids, if it has usable ones (no control token)."""
        got = message.get("token_ids") if message.get("role") == "assistant" else None
        if not got or not all(isinstance(t, int) for t in got):
            return None
        if any(t in self._codec.control_ids for t in got):
            return None            # the model emitted a control token mid-reply: use the text
        return list(got)


def encode_messages(tokenizer, messages: Sequence[dict], *,
                    add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None, limit: int | None = None) -> list[int]:
    """Prompt ids for ``messages`` (``{"role", "content"}`` dicts, OpenAI style; content a
    string or a list of text parts), through the tokenizer's own chat template.

    The template gives the layout: it is rendered with a placeholder for each content, and its
    own markers (``<|im_start|>``, ``<|im_end|>``) become control tokens. Every content is
    tokenised as plain text: ``<|im_start|>`` typed by a user, pasted in a document, in the
    system prompt or in an earlier turn is text, never a control token. An assistant message
    may carry ``"token_ids"``, the ids the engine generated for it: those are used as they are,
    so the next prompt extends the previous one (prompt + generated ids) exactly. Otherwise the
    ids equal encoding the rendered prompt whole, for text without control-token strings.
    Contents go in as given (a template that rewrote them, e.g. stripping, would not apply).
    With ``limit``: :class:`PromptTokensError` (with the count) for more tokens than that.

    ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``) and an assistant
    message's ``tool_calls`` are handed to the template as they are, for it to lay out; a
    control token's text inside them (``<|im_end|>`` in a description, ``</tool_call>`` in an
    argument) is text too. ``tool`` messages' contents are contents like any other.
    """
    return MessageEncoder(tokenizer).encode(messages, add_generation_prompt, tools, limit=limit)


def check_message(text: str | None) -> None:
    """A message must have something in it (checked before anything loads, and per message)."""
    if not text or not text.strip():
        raise EmptyMessageError("The message is empty: type something to send.")


def check_room(max_input_len: int, max_seq_len: int, max_new_tokens: int) -> int:
    """The prompt budget; an error when ``max_new_tokens`` leaves no room for any prompt."""
    budget = prompt_budget(max_input_len, max_seq_len, max_new_tokens)
    if budget <= 0:
        raise PromptTooLongError(
            f"Max new tokens ({max_new_tokens}) leaves no room for a prompt within the "
            f"engine's limit of {max_seq_len} tokens: lower it.")
    return budget


@dataclass
class ChatSession:
    """Conversation state for one user (one browser session, one CLI run)."""

    tokenizer: object
    system_prompt: str | None = None
    messages: list[Message] = field(default_factory=list)   # user/assistant, alternating
    _encoder: MessageEncoder | None = field(default=None, init=False, repr=False, compare=False)

    def _prompt_ids(self, turns, user_text: str, system: bool = True) -> list[int]:
        if self._encoder is None:
            self._encoder = MessageEncoder(self.tokenizer, cache=True)
        return self._encoder.encode(self._template_messages(turns, user_text, system))

    def turns(self) -> list[tuple[Message, Message]]:
        """Completed (user, assistant) pairs, oldest first."""
        out = []
        for i in range(0, len(self.messages) - 1, 2):
            u, a = self.messages[i], self.messages[i + 1]
            if u.role == "user" and a.role == "assistant":
                out.append((u, a))
        return out

    def _template_messages(self, turns, user_text: str, system: bool = True) -> list[dict]:
        msgs: list[dict] = []
        if self.system_prompt and system:
            msgs.append({"role": "system", "content": self.system_prompt})
        for u, a in turns:
            msgs += [u.as_template_dict(), a.as_template_dict()]
        msgs.append({"role": "user", "content": user_text})
        return msgs

    def prepare(self, user_text: str, *, max_input_len: int, max_seq_len: int,
                max_new_tokens: int) -> PromptPlan:
        """Build the prompt ids for ``user_text`` that fit the limits; raises a clear error if
        the message is empty or does not fit even alone."""
        check_message(user_text)
        budget = check_room(max_input_len, max_seq_len, max_new_tokens)
        turns = self.turns()
        alone = self._prompt_ids([], user_text)
        if len(alone) > budget and self.system_prompt:
            bare = len(self._prompt_ids([], user_text, system=False))
            if bare <= budget:
                raise PromptTooLongError(
                    f"The system prompt is too long: it takes {len(alone) - bare} tokens, and "
                    f"with it even this message needs {len(alone)} tokens, over the prompt limit "
                    f"of {budget} tokens (input limit {max_input_len}, {max_new_tokens} kept free "
                    f"for the reply). Shorten the system prompt or lower max new tokens.")
        if len(alone) > budget:
            raise PromptTooLongError(
                f"The message is too long: {len(alone)} tokens with the chat template, but the "
                f"prompt limit is {budget} tokens (input limit {max_input_len}, {max_new_tokens} "
                f"kept free for the reply). Shorten it or lower max new tokens.")
        # Newest turns first: find the largest suffix of turns that fits (binary search, since
        # the length grows monotonically with the number of turns kept).
        lo, hi = 0, len(turns)          # number of newest turns kept: lo fits for sure
        best = alone
        first = True
        while lo < hi:
            mid = hi if first else (lo + hi + 1) // 2   # usually everything fits: try that first
            first = False
            ids = self._prompt_ids(turns[-mid:] if mid else [], user_text)
            if len(ids) <= budget:
                lo, best = mid, ids
            else:
                hi = mid - 1
        self._encoder.keep_used_only()
        return PromptPlan(ids=best, dropped_turns=len(turns) - lo, used_turns=lo, token_budget=budget,
                          messages=self._template_messages(turns[-lo:] if lo else [], user_text))

    def add_exchange(self, user_text: str, reply_text: str, interrupted: bool = False,
                     reply_ids: Sequence[int] | None = None) -> None:
        """Append a turn; ``reply_ids`` are the ids the engine generated for ``reply_text``
        (``Reply.token_ids``): the next prompt reuses them instead of re-encoding the text."""
        self.messages.append(Message("user", user_text))
        self.messages.append(Message("assistant", reply_text, interrupted=interrupted,
                                     token_ids=list(reply_ids) if reply_ids else None))

    def clear(self) -> None:
        self.messages.clear()
