"""OpenAI's Responses API on top of the chat path: ``POST /v1/responses``, ``GET`` / ``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``.

A request is translated into a chat request (:func:`to_chat`): ``instructions`` becomes the
system message; ``input`` (a string, or message / ``function_call`` / ``function_call_output``
items) the messages, after the conversation of ``previous_response_id``; function ``tools``,
``tool_choice`` (``allowed_tools`` too), ``text.format`` (``json_schema`` / ``json_object``: the
same grammar path as ``response_format``), ``temperature``, ``top_p``, ``max_output_tokens``
and the sampling extras chat takes (``top_k``, ``seed``, ...) map to their chat fields. The chat
path checks, encodes, submits and parses it; its stream deltas come back as output items
(:class:`Output`): a ``message`` with one ``output_text`` part per stretch of text, a
``function_call`` per call. Streaming sends the spec's events in its order
(``response.created``, ``response.in_progress``, per item ``response.output_item.added``, for
a message ``response.content_part.added``, ``response.output_text.delta`` ...,
``response.output_text.done``, ``response.content_part.done``, for a call
``response.function_call_arguments.delta`` ... ``.done``, then ``response.output_item.done``;
last ``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut it).
``usage`` counts no reasoning tokens (the model has none); ``reasoning`` is accepted and ignored.

Responses are kept (:mod:`qwen_trt.api.responses_store`) unless ``store`` is false or the
server runs with ``--no-responses-store``; a kept response's conversation (its function calls
and their outputs included) continues with ``previous_response_id``. ``instructions`` are not
carried over (as OpenAI's). Not supported (400 naming the field): other tool types, non-text
input, ``background``, ``conversation``, ``prompt``, ``truncation: auto``, logprobs.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import Response

from qwen_trt.api.chat_run import ChatRun, Done, collect, relay, sse, sse_response
from qwen_trt.api.errors import ApiError, excerpt
from qwen_trt.api.limits import MIB, decode_json
from qwen_trt.api.protocol import ChatRequest, parse_chat_request
from qwen_trt.api.responses_store import ResponseStore, Stored, size_of

# Chat fields a Responses request may carry as extras (the openai SDK's extra_body).
PASSTHROUGH = ("top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "stop", "stop_token_ids", "ignore_eos")
# Fields this server does not do: accepted only at their neutral value.
NEUTRAL = {"background": (None, False), "truncation": (None, "disabled"),
           "max_tool_calls": (None,), "prompt": (None,), "conversation": (None,),
           "context_management": (None,), "top_logprobs": (None, 0), "moderation": (None,)}
MAX_METADATA = 16
LIST_LIMIT = 100


def _bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_store(settings) -> ResponseStore | None:
    """The store ``settings`` ask for (None: ``--no-responses-store``)."""
    if not settings.responses_store:
        return None
    return ResponseStore(settings.responses_store_max,
                         int(settings.responses_store_mb * MIB))


# -- the request -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponsesRequest:
    """One ``POST /v1/responses``, checked (the chat request it becomes: :func:`to_chat`)."""

    input_items: tuple[dict, ...]       # as kept: type, id, status, ...
    chat: dict                          # the chat body, but for its messages
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: tuple[dict, ...] = ()        # the Responses shape, echoed
    tool_choice: object = "auto"
    text: dict = field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict = field(default_factory=dict)
    max_output_tokens: int | None = None
    user: str | None = None


def _text_of(param: str, content, kinds: tuple[str, ...]) -> str:
    """A message's content: a string, or text parts of ``kinds`` (joined by newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(param, f"'{param}' must be a string or a list of text parts.")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{j}]", f"'{param}[{j}]': only text parts ({', '.join(kinds)}) "
                                        f"are supported (this model reads text), got "
                                        f"{excerpt(kind or part)}.")
        parts.append(part["text"])
    return "\n".join(parts)


def _str(obj: Mapping, name: str, param: str, required: bool = True) -> str | None:
    v = obj.get(name)
    if v is None and not required:
        return None
    if not isinstance(v, str) or (required and not v):
        raise _bad(f"{param}.{name}", f"'{param}.{name}' must be a non-empty string.")
    return v


def parse_input(raw) -> tuple[dict, ...]:
    """``input`` as the items kept: messages (text), function calls and their outputs."""
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise _bad("input", "'input' must be a string or a non-empty list of items.")
    out = []
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(param, f"'{param}' must be an object (a message or a function call "
                              "item).")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{param}.role", f"'{param}.role' must be user, system, developer or "
                                            f"assistant, got {excerpt(role)}.")
            if role == "assistant":
                text = _text_of(f"{param}.content", item.get("content"),
                                ("output_text", "input_text", "text"))
                content = [{"type": "output_text", "text": text, "annotations": [],
                            "logprobs": []}]
            else:
                text = _text_of(f"{param}.content", item.get("content"), ("input_text", "text"))
                content = [{"type": "input_text", "text": text}]
            out.append({"type": "message", "id": item.get("id") or _id("msg"), "role": role,
                        "content": content, "status": "completed"})
        elif kind == "function_call":
            args = item.get("arguments", "{}")
            if not isinstance(args, str):
                raise _bad(f"{param}.arguments", f"'{param}.arguments' must be a string (JSON).")
            out.append({"type": "function_call", "id": item.get("id") or _id("fc"),
                        "call_id": _str(item, "call_id", param),
                        "name": _str(item, "name", param), "arguments": args,
                        "status": "completed"})
        elif kind == "function_call_output":
            output = item.get("output")
            text = _text_of(f"{param}.output", output, ("input_text", "output_text", "text"))
            out.append({"type": "function_call_output", "id": item.get("id") or _id("fco"),
                        "call_id": _str(item, "call_id", param), "output": text,
                        "status": "completed"})
        elif kind == "reasoning":
            continue              # another model's reasoning: this one has none to continue
        else:
            raise _bad(f"{param}.type", f"'{param}.type' = {excerpt(kind)} is not supported: "
                                        "send message, function_call or function_call_output "
                                        "items.", code="unsupported_parameter")
    return tuple(out)


def _tools(raw) -> tuple[tuple[dict, ...], list[dict]]:
    """Function tools: as echoed (the Responses shape) and as chat takes them."""
    if raw is None:
        return (), []
    if not isinstance(raw, list):
        raise _bad("tools", "'tools' must be a list of function tools.")
    echo, chat = [], []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise _bad(f"tools[{i}].type", f"'tools[{i}]' must be a function tool "
                                           f"({{\"type\": \"function\", \"name\": ...}}), got "
                                           f"{excerpt(kind)}.", code="unsupported_parameter")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "name": t.get("name"),
                     "description": t.get("description"), "parameters": t.get("parameters"),
                     "strict": t.get("strict")})
    return tuple(echo), chat


def _tool_choice(raw):
    """``tool_choice`` as chat takes it."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    if isinstance(raw, dict) and raw.get("type") == "allowed_tools":
        return {"type": "allowed_tools",
                "allowed_tools": {"mode": raw.get("mode"), "tools": raw.get("tools")}}
    kind = raw.get("type") if isinstance(raw, dict) else raw
    raise _bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required', {\"type\": "
                              "\"function\", \"name\": ...} or allowed_tools, got "
                              f"{excerpt(kind)}.")


def _text_format(raw) -> tuple[dict, dict | None]:
    """``text``: as echoed, and as chat's ``response_format``."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _bad("text", "'text' must be an object ({\"format\": {...}}).")
    if raw.get("verbosity") not in (None, "medium"):
        raise _bad("text.verbosity", "'text.verbosity' other than medium is not supported by "
                                     "this server.", code="unsupported_parameter")
    fmt = raw.get("format")
    if fmt is None:
        fmt = {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                            "json_schema"):
        raise _bad("text.format", "'text.format' must be {\"type\": \"text\" | \"json_object\" | "
                                  "\"json_schema\", ...}.")
    echo = {"format": fmt, "verbosity": "medium"}
    if fmt["type"] != "json_schema":
        return echo, {"type": fmt["type"]}
    js = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    if "schema" not in js:
        raise _bad("text.format.schema", "'text.format.schema' is required for json_schema.")
    return echo, {"type": "json_schema", "json_schema": js}


def _metadata(raw) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in raw.items()):
        raise _bad("metadata", f"'metadata' must be at most {MAX_METADATA} string keys (64 "
                               "characters) with string values (512 characters).")
    return dict(raw)


def parse_responses_request(obj) -> ResponsesRequest:
    """Check a decoded body (400 naming the field)."""
    if not isinstance(obj, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    for name, neutral in NEUTRAL.items():
        v = obj.get(name)
        if not any(v == n and type(v) is type(n) for n in neutral):
            raise _bad(name, f"'{name}' = {excerpt(v)} is not supported by this server (send "
                             "its default or leave it out).", code="unsupported_parameter")
    include = obj.get("include") or []
    if not isinstance(include, list):
        raise _bad("include", "'include' must be a list.")
    if "message.output_text.logprobs" in include:
        raise _bad("include", "logprobs are not reported on /v1/responses (use "
                              "/v1/chat/completions).", code="unsupported_parameter")
    instructions = obj.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions", "'instructions' must be a string.")
    prev = obj.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not prev):
        raise _bad("previous_response_id", "'previous_response_id' must be a response id.")
    for name in ("store", "stream", "parallel_tool_calls"):
        if obj.get(name) is not None and not isinstance(obj[name], bool):
            raise _bad(name, f"'{name}' must be true or false.")
    user = obj.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", "'user' must be a string.")
    echo_tools, chat_tools = _tools(obj.get("tools"))
    text, response_format = _text_format(obj.get("text"))
    max_out = obj.get("max_output_tokens")
    chat = {"model": obj.get("model"), "stream": bool(obj.get("stream")),
            "temperature": obj.get("temperature"), "top_p": obj.get("top_p"),
            "max_tokens": max_out, "tools": chat_tools,
            "tool_choice": _tool_choice(obj.get("tool_choice")),
            "parallel_tool_calls": obj.get("parallel_tool_calls"),
            "response_format": response_format,
            **{k: obj[k] for k in PASSTHROUGH if k in obj}}
    return ResponsesRequest(
        input_items=parse_input(obj.get("input")), chat=chat, instructions=instructions,
        previous_response_id=prev, store=obj.get("store") is not False,
        stream=bool(obj.get("stream")), tools=echo_tools,
        tool_choice=obj.get("tool_choice") if obj.get("tool_choice") is not None else "auto",
        text=text, metadata=_metadata(obj.get("metadata")),
        max_output_tokens=max_out if isinstance(max_out, int) else None, user=user)


def to_messages(instructions: str | None, items) -> list[dict]:
    """Conversation items as chat messages: calls join the assistant turn they follow."""
    msgs: list[dict] = []
    if instructions:
        msgs.append({"role": "system", "content": instructions})
    for it in items:
        kind = it["type"]
        if kind == "message":
            role = "system" if it["role"] == "developer" else it["role"]
            msgs.append({"role": role, "content": "\n".join(p["text"] for p in it["content"])})
        elif kind == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return msgs


RENAMES = (("response_format.json_schema.", "text.format."), ("'max_tokens'",
                                                               "'max_output_tokens'"),
           ("'response_format", "'text.format"), (".function.", "."))


def to_chat(r: ResponsesRequest, history: tuple[dict, ...]) -> ChatRequest:
    """The chat request ``r`` becomes, after ``history`` (400s in the Responses names)."""
    body = {**r.chat, "messages": to_messages(r.instructions, history + r.input_items)}
    try:
        req = parse_chat_request(body)
    except ApiError as e:
        message, param = e.message, e.param or ""
        for old, new in RENAMES:
            message, param = message.replace(old, new), param.replace(old.strip("'"),
                                                                      new.strip("'"))
        if param.startswith("messages"):
            param, message = "input", message.replace("messages", "input (with the history)")
        raise ApiError(e.status, message, param=param or None, code=e.code) from None
    if req.grammar_param == "response_format":
        req = dataclasses.replace(req, grammar_param="text.format")
    return req


# -- the reply ---------------------------------------------------------------------------------
class Output:
    """Chat stream deltas in, Responses output items and their stream events out (without
    ``sequence_number``: the stream numbers them). The whole reply and the stream are built
    by the same steps."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._text: list[str] = []        # the open message's text
        self._args: list[str] = []        # the open call's arguments
        self._open: str | None = None     # "message" | "function_call"

    def _close(self, status: str = "completed") -> list[dict]:
        if self._open is None:
            return []
        at = len(self.items) - 1
        item = self.items[at]
        item["status"] = status
        if self._open == "message":
            text = "".join(self._text)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            ev = [{"type": "response.output_text.done", "item_id": item["id"],
                   "output_index": at, "content_index": 0, "text": text, "logprobs": []},
                  {"type": "response.content_part.done", "item_id": item["id"],
                   "output_index": at, "content_index": 0, "part": part}]
        else:
            item["arguments"] = "".join(self._args)
            ev = [{"type": "response.function_call_arguments.done", "item_id": item["id"],
                   "output_index": at, "name": item["name"], "arguments": item["arguments"]}]
        self._open, self._text, self._args = None, [], []
        return ev + [{"type": "response.output_item.done", "output_index": at,
                      "item": dict(item)}]

    def _message(self) -> list[dict]:
        ev = self._close()
        item = {"id": _id("msg"), "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
        self.items.append(item)
        self._open = "message"
        at = len(self.items) - 1
        return ev + [{"type": "response.output_item.added", "output_index": at,
                      "item": dict(item, content=[])},
                     {"type": "response.content_part.added", "item_id": item["id"],
                      "output_index": at, "content_index": 0,
                      "part": {"type": "output_text", "text": "", "annotations": [],
                               "logprobs": []}}]

    def feed(self, deltas: list[dict]) -> list[dict]:
        ev: list[dict] = []
        for d in deltas:
            if "content" in d:
                if self._open != "message":
                    ev += self._message()
                self._text.append(d["content"])
                ev.append({"type": "response.output_text.delta", "item_id": self.items[-1]["id"],
                           "output_index": len(self.items) - 1, "content_index": 0,
                           "delta": d["content"], "logprobs": []})
                continue
            for tc in d.get("tool_calls", ()):
                fn = tc.get("function", {})
                if "id" in tc:             # a call begins: its name
                    ev += self._close()
                    item = {"id": _id("fc"), "type": "function_call", "call_id": tc["id"],
                            "name": fn["name"], "arguments": "", "status": "in_progress"}
                    self.items.append(item)
                    self._open = "function_call"
                    ev.append({"type": "response.output_item.added",
                               "output_index": len(self.items) - 1, "item": dict(item)})
                if fn.get("arguments"):
                    self._args.append(fn["arguments"])
                    ev.append({"type": "response.function_call_arguments.delta",
                               "item_id": self.items[-1]["id"],
                               "output_index": len(self.items) - 1, "delta": fn["arguments"]})
        return ev

    def finish(self, incomplete: bool) -> list[dict]:
        """The last item closes (``incomplete`` when the length limit cut it); a reply with
        no output at all is one empty message."""
        ev = [] if self.items else self._message()
        return ev + self._close("incomplete" if incomplete else "completed")


def usage(result) -> dict:
    cached = result.cached_tokens or 0
    return {"input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


@dataclass
class _Turn:
    """One response being made: its request, id and what it continues."""

    r: ResponsesRequest
    req: ChatRequest
    model: str
    history: tuple[dict, ...]
    history_bytes: int
    store: ResponseStore | None
    id: str = field(default_factory=lambda: _id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict], result=None, error: dict | None = None,
             ) -> dict:
        r, req = self.r, self.req
        out = {"id": self.id, "object": "response", "created_at": self.created,
               "status": status, "completed_at": None, "error": error,
               "incomplete_details": None, "instructions": r.instructions,
               "max_output_tokens": r.max_output_tokens, "model": self.model,
               "output": output, "parallel_tool_calls": req.tools.parallel,
               "previous_response_id": r.previous_response_id, "reasoning": None,
               "store": self.store is not None and r.store, "temperature": req.temperature,
               "text": r.text, "tool_choice": r.tool_choice, "tools": list(r.tools),
               "top_p": req.top_p, "truncation": "disabled", "background": False,
               "metadata": r.metadata}
        if r.user is not None:
            out["user"] = r.user
        if result is not None:
            out["usage"] = usage(result)
            out["completed_at"] = int(time.time())
            if result.finish_reason == "length":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def keep(self, response: dict, output: list[dict]) -> None:
        if self.store is None or not self.r.store:
            return
        new = self.r.input_items + tuple(output)
        self.store.put(self.id, Stored(response, self.r.input_items, self.history + new,
                                       self.history_bytes + sum(size_of(i) for i in new)))


def _status(done: Done) -> str:
    return "incomplete" if done.result.finish_reason == "length" else "completed"


def add_responses_routes(app: FastAPI, ctx, store: ResponseStore | None) -> None:
    """The Responses routes on ``app`` (``ctx``: :class:`~qwen_trt.api.completions.ApiContext`;
    ``store``: None keeps nothing)."""

    def lookup(rid: str, param: str | None = None) -> Stored:
        if store is None:
            raise ApiError(400 if param else 404, "This server keeps no responses (it runs with "
                                                  "--no-responses-store).", param=param,
                           code="unsupported_parameter" if param else "not_found")
        got = store.get(rid)
        if got is None:
            what = "Previous response" if param else "Response"
            raise ApiError(404, f"{what} with id {excerpt(rid)} not found (it was never kept, "
                                "was deleted, or the store's bound evicted it).", param=param,
                           code="previous_response_not_found" if param else "not_found")
        return got

    @app.post("/v1/responses")
    async def create_response(request: Request):
        ctx.check_auth(request)
        t_in = time.perf_counter()
        r = parse_responses_request(decode_json(await request.body()))
        history, history_bytes = (), 0
        if r.previous_response_id is not None:
            prev = lookup(r.previous_response_id, "previous_response_id")
            history, history_bytes = prev.history, prev.history_bytes
        req = to_chat(r, history)
        turn = _Turn(r, req, ctx.name, history, history_bytes, store)
        run = await ctx.start_chat(req, t_in)
        if r.stream:
            return sse_response(_stream(turn, run), ctx, run)
        out = Output()
        done = await collect(ctx, run, request, out.feed)
        if done is None:                      # the client went away
            return Response(status_code=499)
        out.finish(done.result.finish_reason == "length")
        body = turn.body(_status(done), out.items, done.result)
        turn.keep(body, out.items)
        return body

    async def _stream(turn: _Turn, run: ChatRun) -> AsyncIterator[str]:
        seq = 0

        def events(evs: list[dict]) -> str:
            nonlocal seq
            parts = []
            for ev in evs:
                parts.append(sse(ev["type"], {**ev, "sequence_number": seq}))
                seq += 1
            return "".join(parts)

        start = turn.body("in_progress", [])
        yield events([{"type": "response.created", "response": start},
                      {"type": "response.in_progress", "response": start}])
        out = Output()

        def finish(done: Done) -> str:
            evs = out.finish(done.result.finish_reason == "length")
            status = _status(done)
            body = turn.body(status, out.items, done.result)
            turn.keep(body, out.items)
            return events(evs + [{"type": f"response.{status}", "response": body}])

        def fail(e) -> str:
            body = turn.body("failed", out.items, error={"code": "server_error",
                                                         "message": str(e)})
            return events([{"type": "response.failed", "response": body}])

        async for text in relay(ctx, run, lambda d: events(out.feed(d)), finish, fail):
            yield text

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        ctx.check_auth(request)
        if request.query_params.get("stream") in ("true", "1"):
            raise _bad("stream", "Replaying a response as a stream is not supported.",
                       code="unsupported_parameter")
        return lookup(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        ctx.check_auth(request)
        lookup(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request):
        ctx.check_auth(request)
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise _bad("order", "'order' must be asc or desc.")
        try:
            limit = int(q.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= LIST_LIMIT:
            raise _bad("limit", f"'limit' must be a whole number from 1 to {LIST_LIMIT}.")
        items = list(lookup(response_id).input_items)
        if order == "desc":
            items.reverse()
        after = q.get("after")
        if after is not None:
            at = next((i for i, it in enumerate(items) if it["id"] == after), None)
            if at is None:
                raise _bad("after", f"'after' = {excerpt(after)} is not an item of this "
                                    "response.")
            items = items[at + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "has_more": len(items) > limit,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None}
