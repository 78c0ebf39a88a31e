"""Messages -> prompt ids through the model's own chat template (the code the app uses).

One function, so the prompt path has a single place to change."""
from __future__ import annotations

from collections.abc import Sequence

from qwen_trt.api.errors import ApiError


def encode_messages(tokenizer, messages: Sequence[dict]) -> list[int]:
    from qwen_trt.chat.session import render_prompt_ids

    try:
        return render_prompt_ids(tokenizer, [dict(m) for m in messages])
    except Exception as e:  # the template rejects an odd conversation (no user message, ...)
        if type(e).__name__ not in ("TemplateError", "UndefinedError", "ValueError",
                                    "TemplateSyntaxError"):
            raise
        raise ApiError(400, f"The chat template rejected these messages: {e}".splitlines()[0],
                       param="messages") from e
