"""A multi-turn conversation and the prompt that fits the engine's input limit.

History is kept whole (nothing the user sees is lost); each prompt uses the newest turns that
fit. Oldest whole turns (a user message and its reply) are dropped first; the system prompt and
the newest user message are never dropped; a turn is never split.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from qwen_trt.chat.template import IM_START
from qwen_trt.errors import EmptyMessageError, PromptTooLongError

Role = Literal["system", "user", "assistant"]


@dataclass
class Message:
    role: Role
    content: str
    interrupted: bool = False   # an assistant reply cut short by the user

    def as_template_dict(self) -> dict:
        return {"role": self.role, "content": self.content}


@dataclass
class PromptPlan:
    """What will be sent to the backend for one new user message."""

    ids: list[int]
    dropped_turns: int          # oldest turns left out of this prompt to fit the limit
    used_turns: int             # history turns included
    token_budget: int           # the prompt limit it was fitted to


def render_prompt_text(tokenizer, messages: list[dict]) -> str:
    """The prompt through the tokenizer's own chat template (transformers 4.x and 5.x)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt ids through the tokenizer's own chat template, encoded in one go."""
    return tokenizer.encode(render_prompt_text(tokenizer, messages), add_special_tokens=False)


class PieceEncoder:
    """Encodes chat prompts without re-tokenizing the whole history on every message.

    A tokenizer splits its special tokens out of the text before anything else and encodes the
    stretches between them independently. So cutting the prompt right before each
    ``<|im_start|>`` gives pieces whose ids, concatenated, are exactly the ids of the whole
    (tested); each piece (one rendered message) is encoded once and then reused. Only the text
    is re-rendered per message, which is cheap next to BPE.
    """

    MARKER = IM_START

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        marker = [t for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
                  if str(t) == self.MARKER]
        # Splitting is exact only if the marker is an added token that does not swallow the
        # whitespace before it (lstrip), as in Qwen's tokenizer; otherwise encode in one go.
        self._split = bool(marker) and not getattr(marker[0], "lstrip", False)
        self._ids: dict[str, list[int]] = {}
        self._used: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        if not self._split:
            return self._tok.encode(text, add_special_tokens=False)
        out: list[int] = []
        start = 0
        while start < len(text):
            nxt = text.find(self.MARKER, start + 1)
            end = len(text) if nxt < 0 else nxt
            piece = text[start:end]
            ids = self._used.get(piece) or self._ids.get(piece)
            if ids is None:
                ids = self._tok.encode(piece, add_special_tokens=False)
            self._used[piece] = ids
            out.extend(ids)
            start = end
        return out

    def keep_used_only(self) -> None:
        """Forget pieces the last prompts did not use (bounds memory to one conversation)."""
        self._ids, self._used = self._used, {}


def prompt_budget(max_input_len: int, max_seq_len: int, max_new_tokens: int) -> int:
    """Longest prompt that still leaves room for ``max_new_tokens`` new tokens."""
    return min(max_input_len, max_seq_len - max_new_tokens)


@dataclass
class ChatSession:
    """Conversation state for one user (one browser session, one CLI run)."""

    tokenizer: object
    system_prompt: str | None = None
    messages: list[Message] = field(default_factory=list)   # user/assistant, alternating
    _encoder: PieceEncoder | None = field(default=None, init=False, repr=False, compare=False)

    def _prompt_ids(self, turns, user_text: str) -> list[int]:
        if self._encoder is None:
            self._encoder = PieceEncoder(self.tokenizer)
        return self._encoder.encode(
            render_prompt_text(self.tokenizer, self._template_messages(turns, user_text)))

    def turns(self) -> list[tuple[Message, Message]]:
        """Completed (user, assistant) pairs, oldest first."""
        out = []
        for i in range(0, len(self.messages) - 1, 2):
            u, a = self.messages[i], self.messages[i + 1]
            if u.role == "user" and a.role == "assistant":
                out.append((u, a))
        return out

    def _template_messages(self, turns, user_text: str) -> list[dict]:
        msgs: list[dict] = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        for u, a in turns:
            msgs += [u.as_template_dict(), a.as_template_dict()]
        msgs.append({"role": "user", "content": user_text})
        return msgs

    def prepare(self, user_text: str, *, max_input_len: int, max_seq_len: int,
                max_new_tokens: int) -> PromptPlan:
        """Build the prompt ids for ``user_text`` that fit the limits; raises a clear error if
        the message is empty or does not fit even alone."""
        if not user_text or not user_text.strip():
            raise EmptyMessageError("The message is empty: type something to send.")
        budget = prompt_budget(max_input_len, max_seq_len, max_new_tokens)
        if budget <= 0:
            raise PromptTooLongError(
                f"Max new tokens ({max_new_tokens}) leaves no room for a prompt within the "
                f"engine's limit of {max_seq_len} tokens: lower it.")
        turns = self.turns()
        alone = self._prompt_ids([], user_text)
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
        return PromptPlan(ids=best, dropped_turns=len(turns) - lo, used_turns=lo, token_budget=budget)

    def add_exchange(self, user_text: str, reply_text: str, interrupted: bool = False) -> None:
        self.messages.append(Message("user", user_text))
        self.messages.append(Message("assistant", reply_text, interrupted=interrupted))

    def clear(self) -> None:
        self.messages.clear()
