"""Messages -> prompt ids through the model's own chat template, contents as plain text (a
``<|im_start|>`` typed into a message is text, never a control token): the same encoder the
app uses (:func:`qwen_trt.serving.session.encode_messages`), behind one function here. Tools
and tool calls go to the template as data; control-token text inside them stays text."""
from __future__ import annotations

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
