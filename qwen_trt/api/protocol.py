"""The Chat Completions wire format: a request checked once into a :class:`ChatRequest`, and the
response shapes (``chat.completion``, ``chat.completion.chunk``) clients parse.

Fields clients send at their neutral values (``n: 1``, ``logprobs: false``, ``tools: []``, ...)
are accepted silently, as LangChain and open-webui send them; a non-neutral value of something
this server does not do is a 400 that names the field. Unknown fields are ignored (as vLLM does).
Penalties map to :class:`~qwen_trt.params.SamplingParams` fields when the engine has them.
"""
from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from qwen_trt.api.errors import ApiError, excerpt
from qwen_trt.params import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, SamplingParams

INT64_MAX = 2**63 - 1     # what the engine's integer tensors hold
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOPS = 16

# Penalty field -> its neutral value and allowed range (inclusive unless noted).
PENALTIES: dict[str, tuple[float, float, float]] = {
    "presence_penalty": (0.0, -2.0, 2.0),
    "frequency_penalty": (0.0, -2.0, 2.0),
    "repetition_penalty": (1.0, 0.0, 2.0),      # (0, 2]: 1 = off
}


def _is(*values) -> Callable[[object], bool]:
    return lambda v: any(v == x and type(v) is type(x) for x in values) or v is None


def _empty(v) -> bool:
    return v is None or v == [] or v == {}


# Unsupported features: accepted only at their neutral value.
NEUTRAL: dict[str, Callable[[object], bool]] = {
    "n": _is(1),
    "best_of": _is(1),
    "logprobs": _is(False),
    "top_logprobs": _is(0),
    "echo": _is(False),
    "tools": _empty,
    "functions": _empty,
    "tool_choice": _is("none", "auto"),
    "function_call": _is("none", "auto"),
    "logit_bias": _empty,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "min_p": lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0),
    "min_tokens": _is(0),
    "stop_token_ids": _empty,
    "skip_special_tokens": _is(True),
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _empty,
    "prediction": _empty,
    "web_search_options": _empty,
    "reasoning_effort": _empty,
    "add_generation_prompt": _is(True),
    "continue_final_message": _is(False),
    "guided_json": _empty,
    "guided_regex": _empty,
    "guided_choice": _empty,
    "guided_grammar": _empty,
}


@dataclass(frozen=True)
class ChatRequest:
    """One ``POST /v1/chat/completions``, checked."""

    messages: tuple[dict, ...]            # {"role": system|user|assistant, "content": str}
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None         # None: whatever room the context leaves
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K            # 0 = off (-1 accepted as off, as SGLang)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    penalties: dict = field(default_factory=dict)   # SamplingParams field -> value

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              ignore_eos=self.ignore_eos, **self.penalties)


def _bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _number(obj: Mapping, name: str, default, lo: float, hi: float, *, lo_open=False):
    v = obj.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
        raise _bad(name, f"'{name}' must be a number, got {excerpt(v)}.")
    if v < lo or v > hi or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise _bad(name, f"'{name}' must be in {left}{lo:g}, {hi:g}], got {excerpt(v)}.")
    return float(v)


def _finite(v: int | float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:       # an int too large for a float
        return False


def _int(obj: Mapping, name: str, default, lo: int | None = None, hi: int = INT64_MAX):
    v = obj.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"'{name}' must be an integer, got {excerpt(v)}.")
    if lo is not None and v < lo:
        raise _bad(name, f"'{name}' must be >= {lo}, got {excerpt(v)}.")
    if v > hi:
        raise _bad(name, f"'{name}' must be <= {hi}, got {excerpt(v)}.")
    return v


def _bool(obj: Mapping, name: str, default: bool) -> bool:
    v = obj.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"'{name}' must be true or false, got {excerpt(v)}.")
    return v


def _content(i: int, role: str, content) -> str:
    param = f"messages[{i}].content"
    if content is None:
        if role == "assistant":
            return ""
        raise _bad(param, f"{param} is missing: every {role} message needs text.")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"{param}[{j}]", f"{param}[{j}]: only text parts are supported "
                                            f"(this model reads text), got {excerpt(kind)}.")
            parts.append(part["text"])
        return "\n".join(parts)
    raise _bad(param, f"{param} must be a string or a list of text parts.")


def parse_messages(raw) -> tuple[dict, ...]:
    if raw is None:
        raise _bad("messages", "'messages' is required: a list of {role, content} objects.")
    if not isinstance(raw, list):
        raise _bad("messages", "'messages' must be a list of {role, content} objects.")
    if not raw:
        raise _bad("messages", "'messages' is empty: send at least one message.")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object with role and content.")
        role = m.get("role")
        if role in ("tool", "function"):
            raise _bad(f"messages[{i}].role", f"messages[{i}]: role '{role}' needs tool calling, "
                                              "which this server does not support.")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"messages[{i}].role", f"messages[{i}].role must be one of "
                                              f"{', '.join(ROLES)}, got {excerpt(role)}.")
        if role == "assistant" and not _empty(m.get("tool_calls")):
            raise _bad(f"messages[{i}].tool_calls", "tool calls are not supported by this server.")
        out.append({"role": ROLES[role], "content": _content(i, role, m.get("content"))})
    return tuple(out)


def _valid_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _stops(raw) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", "'stop' must be a string or a list of strings.")
    if len(stops) > MAX_STOPS:
        raise _bad("stop", f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}.")
    return tuple(dict.fromkeys(s for s in stops if s))


def supported_penalties() -> set[str]:
    """Penalty fields the engine's SamplingParams has."""
    return {f.name for f in dataclasses.fields(SamplingParams)} & set(PENALTIES)


def parse_chat_request(obj, *, penalties: set[str] | None = None) -> ChatRequest:
    """Check a decoded JSON body; raises :class:`ApiError` (400) naming the bad field."""
    if not isinstance(obj, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    messages = parse_messages(obj.get("messages"))
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "'model' must be a string.")
    if model and not _valid_text(model):
        raise _bad("model", f"'model' is not valid Unicode text (a lone surrogate): "
                            f"{excerpt(model)}.")
    for name, neutral in NEUTRAL.items():
        if name in obj and not neutral(obj[name]):
            raise _bad(name, f"'{name}' = {excerpt(obj[name])} is not supported by this server "
                             "(send its default or leave it out).", code="unsupported_parameter")
    have = supported_penalties() if penalties is None else penalties
    pens = {}
    for name, (neutral, lo, hi) in PENALTIES.items():
        v = _number(obj, name, neutral, lo, hi, lo_open=name == "repetition_penalty")
        if v != neutral:
            if name not in have:
                raise _bad(name, f"'{name}' = {v:g} is not supported by this engine (send "
                                 f"{neutral:g} or leave it out).", code="unsupported_parameter")
            pens[name] = v
    stream = _bool(obj, "stream", False)
    opts = obj.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options", "'stream_options' must be an object.")
    include_usage = stream and _bool(opts or {}, "include_usage", False)
    max_tokens = _int(obj, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _int(obj, "max_tokens", None, 1)
    top_k = _int(obj, "top_k", DEFAULT_TOP_K, -1)
    seed = _int(obj, "seed", None, 0, 2**64 - 1)
    return ChatRequest(
        messages=messages, model=model or None, stream=stream, include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=_number(obj, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0),
        top_p=_number(obj, "top_p", DEFAULT_TOP_P, 0.0, 1.0, lo_open=True),
        top_k=max(top_k, 0), seed=seed, stop=_stops(obj.get("stop")),
        ignore_eos=_bool(obj, "ignore_eos", False), penalties=pens)


# -- responses ---------------------------------------------------------------------------------
def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:       # prompt tokens served from the engine's prefix cache
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


@dataclass
class ChunkWriter:
    """The ``chat.completion.chunk`` objects of one stream (same id and created on each)."""

    model: str
    include_usage: bool = False
    id: str = field(default_factory=new_id)
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, delta: dict, finish_reason: str | None = None) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
               "model": self.model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish_reason}]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int | None = None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def completion(model: str, text: str, finish_reason: str, prompt_tokens: int,
               completion_tokens: int, cached_tokens: int | None = None) -> dict:
    return {"id": new_id(), "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
