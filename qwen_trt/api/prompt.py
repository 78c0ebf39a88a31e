"""Messages -> prompt ids through the model's own chat template, contents as plain text (a
``<|im_start|>`` typed into a message is text, never a control token): the same encoder the
app uses (:func:`qwen_trt.serving.session.encode_messages`), behind one function here. Tools
and tool calls go to the template as data; control-token text inside them stays text."""
from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from qwen_trt.api.errors import ApiError
from qwen_trt.errors import QwenTrtError, first_line


def encode_messages(tokenizer, messages: Sequence[dict],
                    tools: Sequence[dict] | None = None, *,
                    add_generation_prompt: bool = True, limit: int | None = None,
                    encoder=None) -> list[int]:
    """``messages`` as checked by the protocol (role, content, an assistant's ``tool_calls``,
    and, from the server's own encoder, a reply's ``token_ids``); ``tools`` rendered by the
    template when given. With ``limit``, :class:`~qwen_trt.serving.session.PromptTokensError`
    when there are more (counted without building them). ``encoder``: a
    :class:`~qwen_trt.serving.session.MessageEncoder` to use (its caches) instead of a fresh one."""
    from qwen_trt.serving.session import PromptTokensError
    from qwen_trt.serving.session import encode_messages as encode

    keep = ("role", "content", "tool_calls", "token_ids")
    msgs = [{k: m[k] for k in keep if k in m} for m in messages]
    try:
        if encoder is not None:
            return encoder.encode(msgs, add_generation_prompt, tools, limit=limit)
        return encode(tokenizer, msgs, tools=tools, add_generation_prompt=add_generation_prompt,
                      limit=limit)
    except PromptTokensError:
        raise
    except QwenTrtError as e:   # a message the template has no place for
        raise ApiError(400, str(e), param="messages") from e
    except Exception as e:  # the template rejects an odd conversation (no user message, ...)
        if type(e).__name__ not in ("TemplateError", "UndefinedError", "ValueError",
                                    "TemplateSyntaxError"):
            raise
        raise ApiError(400, first_line(f"The chat template rejected these messages: {e}"),
                       param="messages") from e


class PromptTooLong(Exception):
    """A prompt of more than ``limit`` tokens: ``tokens`` of them (``at_least``: at least that
    many, from the character bound, without tokenising)."""

    def __init__(self, tokens: int, limit: int, at_least: bool = False) -> None:
        super().__init__(f"The prompt comes to {'at least ' if at_least else ''}{tokens} "
                         f"tokens; the limit is {limit}.")
        self.tokens = tokens
        self.limit = limit
        self.at_least = at_least


_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLAIN_LOCK = threading.Lock()


def _plain(tokenizer):
    """A private copy of ``tokenizer``'s fast backend that parses control tokens as
    ``tokenizer.encode`` does (no truncation, no padding), or None for a slow tokenizer. Private:
    transformers sets truncation and padding on the shared backend for each call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    with _PLAIN_LOCK:
        try:
            copy = _PLAIN.get(tokenizer)
        except TypeError:            # not weakly referenceable
            copy = None
        if copy is None:
            from tokenizers import Tokenizer

            copy = Tokenizer.from_str(backend.to_str())
            copy.no_truncation()
            copy.no_padding()
            try:
                _PLAIN[tokenizer] = copy
            except TypeError:
                pass
        return copy


def text_ids_ready(tokenizer) -> bool:
    """Whether :func:`text_ids` has its copy of ``tokenizer`` (making one takes a moment: do
    the first call off the event loop)."""
    try:
        return getattr(tokenizer, "backend_tokenizer", None) is None or tokenizer in _PLAIN
    except TypeError:
        return False


def text_ids(tokenizer, text: str, *, add_special_tokens: bool = True,
             limit: int | None = None, lock: threading.Lock | None = None) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=...)`` (control tokens such as
    ``<|im_start|>`` parsed: the caller's whole input, no template around it), with the GIL
    released while it runs (``encode_batch_fast``: no offsets) so other threads and the event
    loop go on. With ``limit``, :class:`PromptTooLong` when there are more (the ids are only
    counted, never turned into a list). ``lock``: held around a slow tokenizer's call."""
    backend = _plain(tokenizer)
    if backend is None:
        with lock or threading.Lock():
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    else:
        batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        enc = batch([text], add_special_tokens=add_special_tokens)[0]
        if limit is not None and len(enc) > limit:
            raise PromptTooLong(len(enc), limit)
        return list(enc.ids)
    if limit is not None and len(ids) > limit:
        raise PromptTooLong(len(ids), limit)
    return ids
