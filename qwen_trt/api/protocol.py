"""The Chat Completions wire format: a request checked once into a :class:`ChatRequest`, and the
response shapes (``chat.completion``, ``chat.completion.chunk``) clients parse.

Fields clients send at their neutral values (``n: 1``, ``logprobs: false``, ``tools: []``, ...)
are accepted silently, as LangChain and open-webui send them; a non-neutral value of something
this server does not do is a 400 that names the field. Unknown fields are ignored (as vLLM does).
Penalties map to :class:`~qwen_trt.params.SamplingParams` fields when the engine has them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from qwen_trt.api.constraints import parse_response_format
from qwen_trt.api.errors import ApiError, excerpt
from qwen_trt.api.limits import check_text
from qwen_trt.errors import first_line
from qwen_trt.api.tools import ToolSpec, parse_tools
from qwen_trt.params import (DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, MAX_TOP_LOGPROBS,
                             Grammar, SamplingParams)

INT64_MAX = 2**63 - 1     # what the engine's integer tensors hold
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
MAX_STOPS = 16
MAX_N = 8                 # choices per request (n): n submits of the same prompt
MAX_STOP_IDS = 64

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
    "best_of": _is(1),
    "echo": _is(False),
    "functions": _empty,
    "function_call": _is("none", "auto"),
    "min_tokens": _is(0),
    "skip_special_tokens": _is(True),
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _empty,
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
    tools: ToolSpec = ToolSpec()
    grammar: Grammar | None = None        # response_format or tool_choice required / named
    grammar_param: str = ""               # the field it came from (for a 400)
    logprobs: int | None = None           # None = off, else top_logprobs (0..20)
    n: int = 1
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    continuous_usage: bool = False        # stream_options.continuous_usage_stats
    prediction: str | None = None         # predicted output (OpenAI): drafts for speculation
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, -100..100)

    def sampling_params(self, max_new_tokens: int, choice: int = 0,
                        prediction: tuple[int, ...] = ()) -> SamplingParams:
        """The engine's settings for choice ``choice`` (with a seed, choice i samples with
        seed + i, so n choices differ and repeat); ``prediction``: the predicted output's
        token ids."""
        seed = self.seed if self.seed is None or not choice else (self.seed + choice) % 2**64
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=seed,
                              ignore_eos=self.ignore_eos, logprobs=self.logprobs,
                              min_p=self.min_p, stop_token_ids=self.stop_token_ids,
                              grammar=self.grammar, prediction=prediction,
                              logit_bias=self.logit_bias, **self.penalties)

    def choice_params(self, max_new_tokens: int,
                      prediction: tuple[int, ...] = ()) -> list[SamplingParams]:
        """The settings of each of the n choices; a value the engine refuses is a 400."""
        try:
            return [self.sampling_params(max_new_tokens, i, prediction) for i in range(self.n)]
        except ValueError as e:
            raise ApiError(400, first_line(e)) from e


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
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"messages[{i}].role", f"messages[{i}].role must be one of "
                                              f"{', '.join(ROLES)}, got {excerpt(role)}.")
        msg = {"role": ROLES[role]}
        calls = m.get("tool_calls") if role == "assistant" else None
        if not _empty(calls):
            msg["tool_calls"] = _tool_calls(i, calls)
        msg["content"] = ("" if m.get("content") is None and "tool_calls" in msg
                          else _content(i, role, m.get("content")))
        if role == "tool":
            tid = m.get("tool_call_id")
            if tid is not None and not isinstance(tid, str):
                raise _bad(f"messages[{i}].tool_call_id",
                           f"messages[{i}].tool_call_id must be a string.")
        out.append(msg)
    return tuple(out)


def _valid_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _tool_calls(i: int, calls) -> list[dict]:
    """An assistant message's ``tool_calls``, checked: what the chat template lays out."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(param, f"{param} must be a list of tool calls.")
    out = []
    for j, call in enumerate(calls):
        check_text(call, f"{param}[{j}]")
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments", "{}") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name or not isinstance(args, (str, dict)):
            raise _bad(f"{param}[{j}]", f"{param}[{j}] must be {{\"type\": \"function\", "
                                        "\"function\": {\"name\": str, \"arguments\": str}}.")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        out.append({"id": call.get("id") if isinstance(call.get("id"), str) else f"call_{j}",
                    "type": "function", "function": {"name": name, "arguments": args}})
    return out


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


def sampling_penalties(obj: Mapping, penalties: set[str] | None = None) -> dict:
    """The penalty fields of a request that differ from neutral (400 for one the engine's
    SamplingParams lacks, or out of range)."""
    have = supported_penalties() if penalties is None else penalties
    pens = {}
    for name, (neutral, lo, hi) in PENALTIES.items():
        v = _number(obj, name, neutral, lo, hi, lo_open=name == "repetition_penalty")
        if v != neutral:
            if name not in have:
                raise _bad(name, f"'{name}' = {v:g} is not supported by this engine (send "
                                 f"{neutral:g} or leave it out).", code="unsupported_parameter")
            pens[name] = v
    return pens


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
            raise _bad(name, f"'{name}' = {excerpt(obj[name])} is not supported by this "
                             "server (send its default or leave it out).",
                       code="unsupported_parameter")
    pens = sampling_penalties(obj, penalties)
    stream = _bool(obj, "stream", False)
    opts = obj.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("stream_options", "'stream_options' must be an object.")
    # checked whether or not it streams (/openapi.json types them)
    include_usage = _bool(opts or {}, "include_usage", False) and stream
    continuous = _bool(opts or {}, "continuous_usage_stats", False) and stream
    max_tokens = _int(obj, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _int(obj, "max_tokens", None, 1)
    top_k = _int(obj, "top_k", DEFAULT_TOP_K, -1)
    seed = _int(obj, "seed", None, 0, 2**64 - 1)
    tools = parse_tools(obj)
    grammar, grammar_param = tools.grammar(), "tool_choice"
    fmt = parse_response_format(obj)
    if fmt is not None:
        if grammar is not None:
            raise _bad("response_format", "'response_format' cannot be combined with "
                                          "'tool_choice' required or a named function.")
        grammar, grammar_param = fmt, "response_format"
    logprobs = None
    if _bool(obj, "logprobs", False):
        logprobs = _int(obj, "top_logprobs", 0, 0)
        if logprobs > MAX_TOP_LOGPROBS:
            raise _bad("top_logprobs", f"'top_logprobs' must be at most {MAX_TOP_LOGPROBS}, got "
                                       f"{logprobs}.")
    elif _int(obj, "top_logprobs", 0, 0):
        raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true.")
    return ChatRequest(
        messages=messages, model=model or None, stream=stream, include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=_number(obj, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0),
        top_p=_number(obj, "top_p", DEFAULT_TOP_P, 0.0, 1.0),
        top_k=max(top_k, 0), seed=seed, stop=_stops(obj.get("stop")),
        ignore_eos=_bool(obj, "ignore_eos", False), penalties=pens, tools=tools,
        grammar=grammar, grammar_param=grammar_param, logprobs=logprobs, n=parse_n(obj),
        min_p=_number(obj, "min_p", 0.0, 0.0, 1.0), stop_token_ids=parse_stop_ids(obj),
        continuous_usage=continuous, prediction=parse_prediction(obj.get("prediction")),
        logit_bias=parse_logit_bias(obj.get("logit_bias")))


MAX_LOGIT_BIAS = 1024            # entries a request may bias (OpenAI allows 300)


def parse_logit_bias(value) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: ``{"token id": -100..100}`` (the ids checked against the
    vocabulary where the request is submitted)."""
    if value is None or value == {}:
        return ()
    if not isinstance(value, dict):
        raise _bad("logit_bias", "'logit_bias' must be an object of token id -> bias.")
    if len(value) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"'logit_bias' may bias at most {MAX_LOGIT_BIAS} tokens, got "
                                 f"{len(value)}.")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9):
            raise _bad("logit_bias", f"'logit_bias' keys must be token ids (whole numbers as "
                                     f"strings), got {excerpt(key)}.")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -100 <= bias <= 100:
            raise _bad("logit_bias", f"'logit_bias' values must be numbers from -100 to 100, "
                                     f"got {excerpt(bias)} for token {key}.")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def parse_prediction(value) -> str | None:
    """OpenAI's predicted output: ``{"type": "content", "content": TEXT or [text parts]}``
    (None or empty: none)."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict) or value.get("type") != "content" or "content" not in value:
        raise _bad("prediction", "'prediction' must be {\"type\": \"content\", \"content\": "
                                 "...}.")
    content = value["content"]
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise _bad("prediction", "'prediction.content' parts must be "
                                     "{\"type\": \"text\", \"text\": ...}.")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise _bad("prediction", "'prediction.content' must be text or a list of text parts.")
    if not _valid_text(content):
        raise _bad("prediction", "'prediction.content' is not valid Unicode text (a lone "
                                 "surrogate).")
    return content or None


def parse_n(obj: Mapping) -> int:
    n = _int(obj, "n", 1, 1)
    if n > MAX_N:
        raise _bad("n", f"'n' must be at most {MAX_N}, got {n}.")
    return n


def parse_stop_ids(obj: Mapping) -> tuple[int, ...]:
    raw = obj.get("stop_token_ids")
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(type(t) is int and t >= 0 for t in raw):
        raise _bad("stop_token_ids", "'stop_token_ids' must be a list of token ids.")
    if len(raw) > MAX_STOP_IDS:
        raise _bad("stop_token_ids", f"'stop_token_ids' takes at most {MAX_STOP_IDS} ids.")
    return tuple(dict.fromkeys(raw))


# -- responses ---------------------------------------------------------------------------------
def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
          prediction: tuple[int, int] | None = None) -> dict:
    """``prediction``: (accepted, rejected) prediction tokens (OpenAI's
    ``completion_tokens_details``)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:       # prompt tokens served from the engine's prefix cache
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if prediction is not None:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": prediction[0],
                                            "rejected_prediction_tokens": prediction[1]}
    return out


def prediction_counts(prediction: list[int], completion: list[int]) -> tuple[int, int]:
    """(accepted, rejected): the prediction's tokens that appear in the completion, in order
    (the longest matching blocks), and the rest."""
    from difflib import SequenceMatcher

    blocks = SequenceMatcher(None, prediction, completion, autojunk=False).get_matching_blocks()
    accepted = sum(b.size for b in blocks)
    return accepted, len(prediction) - accepted


@dataclass
class ChunkWriter:
    """The ``chat.completion.chunk`` objects of one stream (same id and created on each)."""

    model: str
    include_usage: bool = False
    id: str = field(default_factory=new_id)
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, delta: dict, finish_reason: str | None = None, *, index: int = 0,
              logprobs: dict | None = None, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
               "model": self.model, "choices": [{"index": index, "delta": delta,
                                                 "logprobs": logprobs,
                                                 "finish_reason": finish_reason}]}
        if self.include_usage or usage is not None:
            out["usage"] = usage         # continuous_usage_stats: the counts so far
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int | None = None, prediction=None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens, prediction)}

