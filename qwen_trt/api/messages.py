"""Anthropic's Messages API on top of the chat path: ``POST /v1/messages`` (and
``/v1/messages/count_tokens``).

A request is translated into a chat request: ``system`` (a string or text blocks) becomes the
system message; each message's text blocks its content, an assistant's ``tool_use`` blocks its
tool calls, a user's ``tool_result`` blocks tool messages (in block order); ``tools``
(``name``, ``description``, ``input_schema``), ``tool_choice`` (``auto`` / ``any`` / ``tool`` /
``none``, ``disable_parallel_tool_use``), ``stop_sequences``, ``max_tokens`` (required, as
Anthropic's), ``output_config.format`` (``json_schema``: the grammar path of chat's
``response_format``), ``temperature`` (0..1), ``top_p`` and ``top_k`` map to their chat fields. The chat
path checks, encodes, submits and parses it; its deltas come back as content blocks (``text``,
``tool_use`` with the arguments as ``input``), streamed as Anthropic's events:
``message_start``, per block ``content_block_start``, ``content_block_delta`` (``text_delta`` /
``input_json_delta``) ..., ``content_block_stop``, then ``message_delta`` (``stop_reason``:
``end_turn`` / ``max_tokens`` / ``stop_sequence`` / ``tool_use``, the ``stop_sequence``, the
output tokens) and ``message_stop``. Errors have Anthropic's shape (``{"type": "error",
"error": {"type", "message"}}``), in a stream an ``error`` event. The key is taken from
``x-api-key`` as well as ``Authorization: Bearer``. ``thinking`` is accepted and ignored (the
model has no thinking mode); image and document blocks and server tools are a 400.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from qwen_trt.api.chat_run import (ChatRun, Done, collect, json_object, relay, sse,
                                   sse_response)
from qwen_trt.api.errors import ApiError, excerpt
from qwen_trt.api.limits import decode_json
from qwen_trt.api.protocol import ChatRequest, parse_chat_request

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def _text(param: str, content, what: str = "text") -> str:
    """A string, or text blocks joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(param, f"'{param}' must be a string or a list of {what} blocks.")
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(
                block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else block
            raise _bad(f"{param}[{j}]", f"'{param}[{j}]': only text blocks are supported here "
                                        f"(this model reads text), got {excerpt(kind)}.")
        parts.append(block["text"])
    return "".join(parts)


def _user(i: int, content) -> list[dict]:
    """A user turn: its text, and each tool_result as a tool message, in block order."""
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise _bad(param, f"'{param}' must be a string or a non-empty list of blocks.")
    out: list[dict] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += block["text"]
            else:
                out.append({"role": "user", "content": block["text"]})
        elif kind == "tool_result":
            tid = block.get("tool_use_id")
            if not isinstance(tid, str) or not tid:
                raise _bad(f"{param}[{j}].tool_use_id",
                           f"'{param}[{j}].tool_use_id' must be the id of a tool_use block.")
            text = _text(f"{param}[{j}].content", block.get("content"))
            if block.get("is_error") is True:
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": tid, "content": text})
        else:
            raise _bad(f"{param}[{j}]", f"'{param}[{j}]': a user message takes text and "
                                        f"tool_result blocks (this model reads text), got "
                                        f"{excerpt(kind or block)}.")
    return out


def _assistant(i: int, content) -> dict:
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(param, f"'{param}' must be a string or a list of blocks.")
    text, calls = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(args, dict):
                raise _bad(f"{param}[{j}]", f"'{param}[{j}]' must be {{\"type\": \"tool_use\", "
                                            "\"id\", \"name\", \"input\": {...}}.")
            tid = block.get("id") if isinstance(block.get("id"), str) else f"toolu_{i}_{j}"
            calls.append({"id": tid, "type": "function", "function": {
                "name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue                 # another model's thinking: this one has none to go on
        else:
            raise _bad(f"{param}[{j}]", f"'{param}[{j}]': an assistant message takes text and "
                                        f"tool_use blocks, got {excerpt(kind or block)}.")
    msg = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(raw, system) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", "'messages' must be a non-empty list of {role, content}.")
    out = []
    sys_text = _text("system", system)
    if sys_text:
        out.append({"role": "system", "content": sys_text})
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out += _user(i, m.get("content"))
        elif role == "assistant":
            out.append(_assistant(i, m.get("content")))
        else:
            raise _bad(f"messages[{i}].role", f"'messages[{i}].role' must be user or assistant, "
                                              f"got {excerpt(role)}.")
    return out


def _tools(raw) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad("tools", "'tools' must be a list of tools.")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            kind = t.get("type") if isinstance(t, dict) else t
            raise _bad(f"tools[{i}]", f"'tools[{i}]' must be a client tool ({{\"name\", "
                                      f"\"input_schema\"}}); server tools such as "
                                      f"{excerpt(kind)} are not supported.")
        fn = {"name": t.get("name"), "parameters": t.get("input_schema")}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw) -> tuple[object, bool | None]:
    """Chat's ``tool_choice`` and ``parallel_tool_calls``."""
    if raw is None:
        return None, None
    kind = raw.get("type") if isinstance(raw, dict) else None
    parallel = raw.get("disable_parallel_tool_use") if isinstance(raw, dict) else None
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("tool_choice.disable_parallel_tool_use",
                   "'tool_choice.disable_parallel_tool_use' must be true or false.")
    parallel = None if parallel is None else not parallel
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}, parallel
    raise _bad("tool_choice", "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} "
                              "or {\"type\": \"tool\", \"name\": ...}.")


def parse_messages_request(obj) -> ChatRequest:
    """Check a decoded body into the chat request it becomes (400 naming the field)."""
    if not isinstance(obj, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    max_tokens = obj.get("max_tokens")
    if type(max_tokens) is not int or max_tokens < 1:
        raise _bad("max_tokens", "'max_tokens' is required: a whole number >= 1.")
    t = obj.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                          or not 0 <= t <= 1):
        raise _bad("temperature", f"'temperature' must be a number in [0, 1], got {excerpt(t)}.")
    stops = obj.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list)
                              or not all(isinstance(s, str) for s in stops)):
        raise _bad("stop_sequences", "'stop_sequences' must be a list of strings.")
    if obj.get("mcp_servers"):
        raise _bad("mcp_servers", "'mcp_servers' is not supported by this server.")
    choice, parallel = _tool_choice(obj.get("tool_choice"))
    fmt = (obj.get("output_config") or {}).get("format") if isinstance(
        obj.get("output_config") or {}, dict) else None
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "json_schema"
                            or not isinstance(fmt.get("schema"), dict)):
        raise _bad("output_config.format", "'output_config.format' must be {\"type\": "
                                           "\"json_schema\", \"schema\": {...}}.")
    body = {"model": obj.get("model"), "stream": obj.get("stream"), "max_tokens": max_tokens,
            "messages": _messages(obj.get("messages"), obj.get("system")),
            "temperature": t, "top_p": obj.get("top_p"), "top_k": obj.get("top_k"),
            "stop": stops, "tools": _tools(obj.get("tools")), "tool_choice": choice,
            "parallel_tool_calls": parallel,
            "response_format": fmt and {"type": "json_schema",
                                        "json_schema": {"schema": fmt["schema"]}}}
    try:
        req = parse_chat_request(body)
        if req.grammar_param == "response_format":
            req = dataclasses.replace(req, grammar_param="output_config.format")
        return req
    except ApiError as e:
        message, param = e.message, e.param
        if param and param.startswith("tools[") and ".function." in param:
            param = param.replace(".function.parameters", ".input_schema").replace(
                ".function.", ".")
            message = message.replace(".function.parameters", ".input_schema").replace(
                ".function.", ".")
        if param == "stop":
            param, message = "stop_sequences", message.replace("'stop'", "'stop_sequences'")
        raise ApiError(e.status, message, param=param, code=e.code) from None


class Blocks:
    """Chat stream deltas in, content blocks and their stream events out (the whole reply and
    the stream are built by the same steps)."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._args: list[str] = []
        self._open = False

    def _close(self) -> list[dict]:
        if not self._open:
            return []
        self._open = False
        block = self.blocks[-1]
        if block["type"] == "tool_use":
            block["input"] = json_object("".join(self._args))
            self._args = []
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _start(self, block: dict) -> list[dict]:
        ev = self._close()
        self.blocks.append(block)
        self._open = True
        return ev + [{"type": "content_block_start", "index": len(self.blocks) - 1,
                      "content_block": dict(block)}]

    def feed(self, deltas: list[dict]) -> list[dict]:
        ev: list[dict] = []
        for d in deltas:
            if "content" in d:
                if not (self._open and self.blocks[-1]["type"] == "text"):
                    ev += self._start({"type": "text", "text": ""})
                self.blocks[-1]["text"] += d["content"]
                ev.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                           "delta": {"type": "text_delta", "text": d["content"]}})
                continue
            for tc in d.get("tool_calls", ()):
                fn = tc.get("function", {})
                if "id" in tc:
                    ev += self._start({"type": "tool_use", "id": tc["id"], "name": fn["name"],
                                       "input": {}})
                if fn.get("arguments"):
                    self._args.append(fn["arguments"])
                    ev.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                               "delta": {"type": "input_json_delta",
                                         "partial_json": fn["arguments"]}})
        return ev

    def finish(self) -> list[dict]:
        return self._close()


def stop_of(done: Done) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence``."""
    stop = getattr(done.result, "stop", None)
    if done.reason == "stop" and stop is not None:
        return "stop_sequence", stop
    return STOP_REASONS.get(done.reason, "end_turn"), None


def _usage(n_prompt: int, output: int, cached: int | None) -> dict:
    out = {"input_tokens": n_prompt, "output_tokens": output}
    if cached is not None:
        out["cache_read_input_tokens"] = cached
    return out


def add_messages_routes(app: FastAPI, ctx) -> None:
    """``POST /v1/messages`` on ``app`` (``ctx``: :class:`~qwen_trt.api.completions.ApiContext`)."""

    def message(mid: str, blocks: list[dict], reason, stop, use: dict) -> dict:
        return {"id": mid, "type": "message", "role": "assistant", "model": ctx.name,
                "content": blocks, "stop_reason": reason, "stop_sequence": stop, "usage": use}

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            return await create(request)
        except ApiError as e:
            return JSONResponse(error_body(e.status, e.message), status_code=e.status,
                                headers=e.headers)

    async def create(request: Request):
        ctx.check_auth(request)
        t_in = time.perf_counter()
        req = parse_messages_request(decode_json(await request.body()))
        run = await ctx.start_chat(req, t_in)
        mid = f"msg_{uuid.uuid4().hex}"
        if req.stream:
            return sse_response(_stream(mid, run), ctx, run)
        blocks = Blocks()
        done = await collect(ctx, run, request, blocks.feed)
        if done is None:                      # the client went away
            return Response(status_code=499)
        blocks.finish()
        reason, stop = stop_of(done)
        r = done.result
        return message(mid, blocks.blocks, reason, stop,
                       _usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """The prompt's tokens, as ``/v1/messages`` would encode it (``max_tokens`` not needed)."""
        try:
            ctx.check_auth(request)
            obj = decode_json(await request.body())
            if isinstance(obj, dict):
                obj = {**obj, "max_tokens": 1}
            req = parse_messages_request(obj)
            ids = await ctx.encode_chat(list(req.messages),
                                        req.tools.tools if req.tools.render else None)
        except ApiError as e:
            return JSONResponse(error_body(e.status, e.message), status_code=e.status,
                                headers=e.headers)
        return {"input_tokens": len(ids)}

    async def _stream(mid: str, run: ChatRun) -> AsyncIterator[str]:
        def events(evs: list[dict]) -> str:
            return "".join(sse(ev["type"], ev) for ev in evs)

        yield events([{"type": "message_start", "message": message(
            mid, [], None, None, _usage(run.n_prompt, 0, None))}])
        blocks = Blocks()

        def finish(done: Done) -> str:
            reason, stop = stop_of(done)
            return events(blocks.finish() + [
                {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop},
                 "usage": {"output_tokens": done.result.completion_tokens}},
                {"type": "message_stop"}])

        async for text in relay(ctx, run, lambda d: events(blocks.feed(d)), finish,
                                lambda e: sse("error", error_body(e.status, str(e)))):
            yield text
