"""Messages -> prompt ids through the model's own chat template, contents as plain text (a
``<|im_start|>`` typed into a message is text, never a control token): the same encoder the
app uses (:func:`qwen_trt.chat.session.encode_messages`), behind one function here."""
from __future__ import annotations

from collections.abc import Sequence

from qwen_trt.api.errors import ApiError
from qwen_trt.errors import QwenTrtError


def encode_messages(tokenizer, messages: Sequence[dict], encoder=None) -> list[int]:
    """``encoder``: a :class:`~qwen_trt.chat.session.MessageEncoder` to use (its caches)
    instead of a fresh one; messages may then carry an assistant reply's ``token_ids``."""
    from qwen_trt.chat.session import encode_messages as encode

    try:
        if encoder is not None:
            return encoder.encode(list(messages))
        return encode(tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])
    except QwenTrtError as e:   # a message the template has no place for
        raise ApiError(400, str(e), param="messages") from e
    except Exception as e:  # the template rejects an odd conversation (no user message, ...)
        if type(e).__name__ not in ("TemplateError", "UndefinedError", "ValueError",
                                    "TemplateSyntaxError"):
            raise
        raise ApiError(400, f"The chat template rejected these messages: {e}".splitlines()[0],
                       param="messages") from e
