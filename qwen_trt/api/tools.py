"""Tool calling on the wire: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` checked into a
:class:`ToolSpec`, and the model's ``<tool_call>`` blocks parsed out of its reply.

Qwen3 writes a call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(Hermes style, as its chat template asks). :class:`ToolCallParser` reads the reply text as it
streams: text outside a block is content. A block that begins ``{"name": "<name>",
"arguments": {`` is a call from then on: :class:`CallStart` (its id and name) at once, then
:class:`CallArguments` pieces with the arguments object's text as the model writes it (they
join to the call's ``arguments``), then the whole :class:`ToolCall` when the object (or the
block, or the reply) ends. Any other block waits for its end and becomes a call if its JSON
parses (a name, an object of arguments, or arguments quoted as a string), the same three
pieces at once; a block that does not parse, or that is still open at the end of the reply
without a complete call in it, stays content, word for word. Whitespace around calls is not
content. Only the model's reply is parsed: the same tags typed in a user or tool message are
encoded as text (:mod:`qwen_trt.serving.session`).

``tool_choice``:

* ``auto`` (the default when tools are given): the tools are rendered, the reply is parsed;
* ``none``: the tools are not rendered (the model is not told about them) and the reply is not
  parsed, so it is plain content; earlier tool calls and results in the history still render;
* ``required`` / ``{"type": "function", "function": {"name": ...}}``: the reply is constrained
  to call blocks (``SamplingParams.grammar`` of kind ``tool_calls``; several only with
  ``parallel_tool_calls``), for a named function that one only.
* ``{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [{"type":
  "function", "function": {"name": ...}}, ...]}}``: only the named tools are rendered (the model
  is told of no other), then ``mode`` applies as ``auto`` / ``required`` above.

``parallel_tool_calls`` shapes only the constraint: in ``auto`` mode every call the model
writes is returned.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from qwen_trt.api.errors import ApiError
from qwen_trt.api.limits import check_text
from qwen_trt.model.template import TOOL_CALL_END, TOOL_CALL_START
from qwen_trt.params import Grammar

NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 128


def _excerpt(value, limit: int = 40) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False,
                                                           default=str)
    return text if len(text) <= limit else text[:limit] + "…"


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class ToolSpec:
    """The tools of one request, checked."""

    tools: tuple[dict, ...] = ()          # OpenAI's {"type": "function", "function": {...}}
    choice: str = "auto"                  # auto | none | required | the named function
    named: bool = False                   # choice is a function name
    parallel: bool = True

    @property
    def render(self) -> bool:
        """Whether the tools go into the prompt."""
        return bool(self.tools) and self.choice != "none"

    @property
    def parse(self) -> bool:
        """Whether the reply is read for tool calls."""
        return self.render

    def grammar(self) -> Grammar | None:
        if not self.tools or self.choice in ("auto", "none"):
            return None
        fns = [t["function"] for t in self.tools]
        if self.named:
            fns = [f for f in fns if f["name"] == self.choice]
        spec = {"tools": [{"name": f["name"],
                           "parameters": f.get("parameters") or {"type": "object"}}
                          for f in fns],
                "parallel": self.parallel and not self.named}
        return Grammar("tool_calls", json.dumps(spec, ensure_ascii=False))


def _function(i: int, tool) -> dict:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise _bad(param, f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}.")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{param}.function", f"{param}.function must be an object with a name.")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise _bad(f"{param}.function.name",
                   f"{param}.function.name must be 1 to 64 letters, digits, '_', '-' or '.', "
                   f"got {_excerpt(name)!r}.")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise _bad(f"{param}.function.description", f"{param}.function.description must be a "
                                                    "string.")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise _bad(f"{param}.function.parameters",
                   f"{param}.function.parameters must be a JSON schema object.")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{param}.function.strict", f"{param}.function.strict must be true or false.")
    out = {"name": name}
    if desc is not None:
        out["description"] = desc
    if params is not None:
        out["parameters"] = params
    return {"type": "function", "function": out}


def parse_tools(obj: Mapping) -> ToolSpec:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a request body (400 naming
    the field when one is wrong)."""
    raw = obj.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise _bad("tools", "'tools' must be a list of function tools.")
    if len(raw) > MAX_TOOLS:
        raise _bad("tools", f"'tools' takes at most {MAX_TOOLS} tools, got {len(raw)}.")
    check_text(raw, "tools")
    tools = tuple(_function(i, t) for i, t in enumerate(raw))
    names = [t["function"]["name"] for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise _bad("tools", f"'tools' names the function {dup!r} twice.")
    parallel = obj.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    elif not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "'parallel_tool_calls' must be true or false.")
    choice = obj.get("tool_choice")
    named = False
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        tools, choice = _allowed(choice.get("allowed_tools"), tools)
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                      "{\"type\": \"function\", \"function\": {\"name\": ...}}.")
        if name not in names:
            raise _bad("tool_choice", f"'tool_choice' names the function {_excerpt(name)!r}, "
                                      "which is not in 'tools'.")
        choice, named = name, True
    elif choice not in ("none", "auto", "required"):
        raise _bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required', "
                                  f"allowed_tools or a named function, got {_excerpt(choice)!r}.")
    if choice == "required" and not tools:
        raise _bad("tool_choice", "'tool_choice' is 'required' but 'tools' is empty.")
    return ToolSpec(tools=tools, choice=choice, named=named, parallel=parallel)


def _allowed(allowed, tools: tuple[dict, ...]) -> tuple[tuple[dict, ...], str]:
    """``tool_choice.allowed_tools`` checked: the tools it names (in ``tools``' order) and its
    mode. A name is given as ``{"type": "function", "function": {"name": N}}`` (Chat
    Completions) or ``{"type": "function", "name": N}`` (the Responses API's form)."""
    param = "tool_choice.allowed_tools"
    if not isinstance(allowed, dict) or allowed.get("mode") not in ("auto", "required") \
            or not isinstance(allowed.get("tools"), list) or not allowed["tools"]:
        raise _bad(param, f"'{param}' must be {{\"mode\": \"auto\" | \"required\", \"tools\": "
                          "[{\"type\": \"function\", \"function\": {\"name\": ...}}, ...]} with "
                          "at least one tool.")
    have = {t["function"]["name"] for t in tools}
    names = set()
    for i, t in enumerate(allowed["tools"]):
        fn = t.get("function") if isinstance(t, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else (
            t.get("name") if isinstance(t, dict) else None)
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(name, str):
            raise _bad(f"{param}.tools[{i}]", f"'{param}.tools[{i}]' must be {{\"type\": "
                                              "\"function\", \"function\": {\"name\": ...}}.")
        if name not in have:
            raise _bad(f"{param}.tools[{i}]", f"'{param}.tools[{i}]' names the function "
                                              f"{_excerpt(name)!r}, which is not in 'tools'.")
        names.add(name)
    return tuple(t for t in tools if t["function"]["name"] in names), allowed["mode"]


# -- the reply ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                      # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def parse_call(body: str) -> ToolCall | None:
    """One block's inside as a call, or None when it is not ``{"name": str, "arguments": {}}``."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", {})
    if isinstance(args, str):          # some replies quote the arguments
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


@dataclass(frozen=True)
class CallStart:
    """A call begins: its id and name (its arguments follow as :class:`CallArguments`)."""

    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """More of the arguments of the call begun last, as text."""

    text: str


# The head of a block that streams: the name, then the arguments object (its first brace next).
_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
HEAD_CHARS = 512          # a block whose head has not shown by now waits for its end


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could still grow into ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _Arguments:
    """Where a streamed arguments object ends: JSON nesting and strings, char by char."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.text: list[str] = []

    def scan(self, buf: str) -> tuple[int, str]:
        """How much of ``buf`` belongs to the arguments, and what stopped the scan: ``done``
        (the object closed), ``end`` (``</tool_call>`` outside a string: the block ended
        early), ``more`` (all of ``buf`` is arguments; or a possible tag start is held)."""
        for i, c in enumerate(buf):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1, "done"
            elif c == "<":
                rest = buf[i:]
                if rest.startswith(TOOL_CALL_END):
                    return i, "end"
                if TOOL_CALL_END.startswith(rest):
                    return i, "more"
        return len(buf), "more"


class ToolCallParser:
    """Reply text in (as it streams), content and call pieces out.

    :meth:`feed` returns what is settled, in order: strings (content), :class:`CallStart`,
    :class:`CallArguments` and the finished :class:`ToolCall` (module docstring); text that may
    still turn out to be a tag, and whitespace that may turn out to sit next to a call, is held
    back. :meth:`finish` returns the rest. Joining every string piece gives the content of the
    whole reply, and every call's argument pieces its ``arguments``, the same however the text
    was cut into deltas.
    """

    def __init__(self) -> None:
        self._buf = ""            # outside a block: unsent text; inside: the block's unread body
        self._in_call = False
        self._mode = "head"       # inside a block: head | args | tail | whole (wait for its end)
        self._open: ToolCall | None = None   # the call streaming (its arguments in _args)
        self._args: _Arguments | None = None
        self._space = ""          # whitespace held back after the last content
        self._after_call = False  # no content since the last call
        self.calls: list[ToolCall] = []

    def _content(self, text: str, out: list) -> None:
        text = self._space + text
        if self._after_call:
            text = text.lstrip()
        stripped = text.rstrip()
        self._space = text[len(stripped):]
        if stripped:
            out.append(stripped)
            self._after_call = False

    def _begin(self, name: str, out: list) -> None:
        self._open = ToolCall(name, "")
        self._space, self._after_call = "", True   # whitespace around a call is not content
        out.append(CallStart(self._open.id, name))

    def _close(self, out: list) -> None:
        """The streaming call is whole: its arguments are the text sent."""
        call = ToolCall(self._open.name, "".join(self._args.text), self._open.id)
        self._open, self._args = None, None
        self.calls.append(call)
        out.append(call)

    def _whole(self, call: ToolCall, out: list) -> None:
        self._begin(call.name, out)
        self._args = _Arguments()
        self._args.text.append(call.arguments)
        out.append(CallArguments(call.arguments))
        self._close(out)

    def _block_ends(self, body: str, out: list) -> None:
        """A block that never streamed ends with ``body``: a call, or content as it was."""
        call = parse_call(body)
        if call is None:
            self._content(TOOL_CALL_START + body + TOOL_CALL_END, out)
        else:
            self._whole(call, out)

    def _head(self, out: list) -> bool:
        """Whether the block's head (name, arguments' first brace) is here: then it streams."""
        end = self._buf.find(TOOL_CALL_END)
        m = _HEAD_RE.match(self._buf, 0, end if end >= 0 else len(self._buf))
        if m is None or self._buf[m.end():m.end() + 1] != "{":
            if (m is not None and m.end() < len(self._buf)) or (
                    end < 0 and len(self._buf) > HEAD_CHARS):
                self._mode = "whole"    # arguments quoted as a string, or no head in sight
            return False
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            name = ""
        if not name:
            self._mode = "whole"
            return False
        self._begin(name, out)
        self._args = _Arguments()
        self._buf = self._buf[m.end():]
        self._mode = "args"
        return True

    def _in_block(self, out: list) -> bool:
        """Read the block's body; whether the block ended (then the loop goes on outside)."""
        if self._mode == "head" and not self._head(out):
            if self._mode == "head" and TOOL_CALL_END not in self._buf:
                return False
            self._mode = "whole"
        if self._mode == "args":
            n, why = self._args.scan(self._buf)
            if n:
                self._args.text.append(self._buf[:n])
                out.append(CallArguments(self._buf[:n]))
                self._buf = self._buf[n:]
            if why == "more":
                return False
            if why == "done":
                self._mode = "tail"
        end = self._buf.find(TOOL_CALL_END)
        if end < 0:
            return False
        body = self._buf[:end]
        self._buf = self._buf[end + len(TOOL_CALL_END):]
        self._in_call, self._mode = False, "head"
        if self._open is not None:
            self._close(out)         # what followed the arguments object is dropped
        else:
            self._block_ends(body, out)
        return True

    def feed(self, text: str) -> list:
        out: list = []
        self._buf += text
        while True:
            if not self._in_call:
                at = self._buf.find(TOOL_CALL_START)
                if at < 0:
                    keep = _held_prefix(self._buf, TOOL_CALL_START)
                    self._content(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(self._buf[:at], out)
                self._buf = self._buf[at + len(TOOL_CALL_START):]
                self._in_call, self._mode = True, "head"
            elif not self._in_block(out):
                return out

    def finish(self) -> list:
        out: list = []
        if self._in_call:
            if self._open is not None:          # the reply ended inside a streaming call
                if self._mode == "args" and self._buf:
                    self._args.text.append(self._buf)
                    out.append(CallArguments(self._buf))
                self._close(out)
            else:
                call = parse_call(self._buf)    # the reply ended before </tool_call>
                if call is not None:
                    self._whole(call, out)
                else:
                    self._content(TOOL_CALL_START + self._buf, out)
        elif self._buf:
            self._content(self._buf, out)
        self._buf, self._in_call, self._mode = "", False, "head"
        if self._space and not self.calls:
            out.append(self._space)
        self._space = ""
        return out


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply: its content and its calls (as :class:`ToolCallParser` streams them)."""
    p = ToolCallParser()
    pieces = p.feed(text) + p.finish()
    return "".join(x for x in pieces if isinstance(x, str)), p.calls
