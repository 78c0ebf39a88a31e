"""What one request may cost the server: the body size (413 while it is read), the JSON it
decodes to (400, never a 500), and a prompt that cannot fit the context (400 before tokenising).

The cheap prompt bound: a token stands for at most ``L`` characters of normalised text, where
``L`` is the longest token of the vocabulary (a byte-level token of ``b`` bytes covers at most
``b`` characters, an added token its content), and normalisation can merge at most ``k`` input
characters into one (``k`` = 4 for NFC/NFD, the longest canonical decomposition; 18 for
NFKC/NFKD; 1 for none or lower-casing). So a text of ``c`` characters is at least
``ceil(c / (k * L))`` tokens, and the template only adds tokens. Where the tokenizer could turn
many characters into one token in a way not covered here (an ``<unk>`` for an unknown word,
a normaliser or pre-tokenizer that deletes text), :func:`chars_per_token` is None and no
request is refused by the bound: it never refuses a prompt that would fit.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence

from qwen_trt.api.errors import ApiError, error_body

MIB = 1024 * 1024

# How many input characters normalisation can turn into one (see the module docstring).
_NORMALIZER_MERGE = {"NFC": 4, "NFD": 4, "NFKC": 18, "NFKD": 18, "Lowercase": 1}
# Pre-tokenizers that keep every character of the text (Split/Punctuation unless "Removed").
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation", "Metaspace"}
_SURROGATE = re.compile("[\ud800-\udfff]")


# -- the context ---------------------------------------------------------------------------------
def context_too_long(ctx: int, max_input: int, n: int, max_tokens: int | None = None, *,
                     what: str = "messages", bound: bool = False) -> ApiError:
    """The one 400 for a request that cannot fit the context of ``ctx`` tokens (prompts up to
    ``max_input``): ``n`` tokens (``bound``: at least ``n``) in the ``what`` ("messages",
    "prompt"), plus ``max_tokens`` when the completion is what overflows (None: the prompt
    alone does)."""
    head = f"This model's maximum context length is {ctx} tokens (prompts up to {max_input})."
    least = "at least " if bound else ""
    if max_tokens is None:
        return ApiError(400, f"{head} However, your {what} resulted in {least}{n} tokens. Please "
                             f"shorten the {what}.", param=what, code="context_length_exceeded")
    return ApiError(400, f"{head} However, you requested {least}{n + max_tokens} tokens "
                         f"({least}{n} in the {what}, {max_tokens} in the completion). Please "
                         f"reduce the length of the {what} or the completion.",
                    param="max_tokens" if what == "messages" else what,
                    code="context_length_exceeded")


# -- JSON ----------------------------------------------------------------------------------------
def json_number(text: str) -> int | float:
    """A JSON number written with a fraction or exponent: an int when its value is whole (JSON
    Schema's ``integer`` includes ``334.0``, so /openapi.json's integer fields take it too)."""
    v = float(text)
    return int(v) if v.is_integer() and abs(v) <= 2 ** 63 - 1 else v


def decode_json(raw: bytes):
    """The decoded body; a 400 for anything that is not JSON (bad UTF-8, nesting too deep)."""
    try:
        return json.loads(raw, parse_float=json_number)
    except RecursionError:
        raise ApiError(400, "The body's JSON is nested too deeply.", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"The body is not valid JSON ({str(e)[:120]}).",
                       code="invalid_json") from None


# -- the body ------------------------------------------------------------------------------------
class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body is larger than this server takes "
                              f"({limit / MIB:g} MiB, --max-body-mb).", code="request_too_large",
                         headers={"Connection": "close"})


class BodyLimit:
    """ASGI middleware: an HTTP request body of more than ``max_bytes`` gets a 413 in OpenAI's
    shape. A ``Content-Length`` above it is refused before any of the body is read; a chunked
    body is counted as it arrives and refused once past the limit (raised from ``receive()``,
    so the route's error handler answers). Never holds more than the limit."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > limit
                except ValueError:
                    too_big = False            # h11 refuses a malformed length itself
                if too_big:
                    return await _send_error(send, BodyTooLarge(limit))
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        return await self.app(scope, counted, send)


async def _send_error(send, e: ApiError) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in (e.headers or {}).items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_response_bytes(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection (for the protocol layer)."""
    body = json.dumps(error_body(message, status, code=code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


# -- the prompt ----------------------------------------------------------------------------------
def _parts(node) -> list[dict]:
    if not node:
        return []
    if node.get("type") == "Sequence":
        inner = node.get("normalizers") or node.get("pretokenizers") or []
        return [p for n in inner for p in _parts(n)]
    return [node]


def chars_per_token(tokenizer) -> int | None:
    """The most characters of message text one token can stand for, or None where the
    tokenizer gives no such bound (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        cfg = json.loads(backend.to_str())
    except (ValueError, AttributeError):
        return None
    merge = 1
    for n in _parts(cfg.get("normalizer")):
        k = _NORMALIZER_MERGE.get(n.get("type"))
        if k is None:
            return None
        merge *= k
    pre = _parts(cfg.get("pre_tokenizer"))
    if any(p.get("type") not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed"
           for p in pre):
        return None
    model = cfg.get("model") or {}
    byte_level = any(p.get("type") == "ByteLevel" for p in pre)
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None          # an unknown character could become one <unk> for a whole run
    vocab = model.get("vocab") or {}
    if not vocab:
        return None
    # a byte-level token's string has one character per byte; otherwise count UTF-8 bytes
    longest = max(len(t) if byte_level else len(t.encode("utf-8", "surrogatepass")) for t in vocab)
    for added in cfg.get("added_tokens") or []:
        longest = max(longest, len(added.get("content", "")))
    return merge * max(longest, 1)


def text_chars(messages: Sequence[dict]) -> int:
    """Characters of message text a tokenizer sees (lone surrogates not counted: they become
    at most as many replacement characters, or merge into one)."""
    total = 0
    for m in messages:
        content = m.get("content") or ""
        total += len(content)
        if _SURROGATE.search(content):
            total -= len(_SURROGATE.findall(content))
    return total


def min_prompt_tokens(messages: Sequence[dict], per_token: int | None) -> int:
    """A number of tokens the prompt has at least (0 when the tokenizer gives no bound)."""
    if not per_token:
        return 0
    return math.ceil(text_chars(messages) / per_token)


# -- text ----------------------------------------------------------------------------------------
def lone_surrogate(value) -> str | None:
    """Where the first lone surrogate in ``value`` (decoded JSON: a string, or lists and objects
    of them, keys included) is: ``""`` for ``value`` itself, else a path such as
    ``[0].function.name``; None when there is none. No tokenizer or JSON encoder takes one, and
    JSON may spell it (``"\\ud800"``). Iterative, each step linked to its parent: any depth the
    decoder allowed, in time and memory linear in the value."""
    stack = [(value, None)]           # (value, (parent link, its key or index) or None)
    while stack:
        v, link = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return _path(link)
        elif isinstance(v, dict):
            for k in v:
                if isinstance(k, str) and _SURROGATE.search(k):
                    return _path(link)
            stack.extend((item, (link, k)) for k, item in reversed(list(v.items())))
        elif isinstance(v, (list, tuple)):
            stack.extend((v[i], (link, i)) for i in range(len(v) - 1, -1, -1))
    return None


def _path(link) -> str:
    parts = []
    while link is not None:
        link, key = link
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key[:40]}")
    return "".join(reversed(parts))


def check_text(value, param: str) -> None:
    """A 400 naming where ``value`` (the field ``param``) holds a lone surrogate."""
    where = lone_surrogate(value)
    if where is not None:
        raise ApiError(400, f"'{param}{where}' is not valid Unicode text (it holds a lone "
                            "surrogate).", param=f"{param}{where}")
