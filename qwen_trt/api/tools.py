"""Tool calling on the wire: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` checked into a
:class:`ToolSpec`, and the model's ``<tool_call>`` blocks parsed out of its reply.

Qwen3 writes a call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(Hermes style, as its chat template asks). :class:`ToolCallParser` reads the reply text as it
streams: text outside a block is content; a block becomes a :class:`ToolCall` once it closes
and its JSON parses (a name, an object of arguments); a block that does not parse, or that is
still open at the end of the reply without a complete call in it, stays content, word for
word. Whitespace around calls is not content. Only the model's reply is parsed: the same tags
typed in a user or tool message are encoded as text (:mod:`qwen_trt.serving.session`).

``tool_choice``:

* ``auto`` (the default when tools are given): the tools are rendered, the reply is parsed;
* ``none``: the tools are not rendered (the model is not told about them) and the reply is not
  parsed, so it is plain content; earlier tool calls and results in the history still render;
* ``required`` / ``{"type": "function", "function": {"name": ...}}``: the reply is constrained
  to call blocks (``SamplingParams.grammar`` of kind ``tool_calls``; several only with
  ``parallel_tool_calls``), for a named function that one only.

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
        raise _bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                  f"a named function, got {_excerpt(choice)!r}.")
    if choice == "required" and not tools:
        raise _bad("tool_choice", "'tool_choice' is 'required' but 'tools' is empty.")
    return ToolSpec(tools=tools, choice=choice, named=named, parallel=parallel)


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


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could still grow into ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """Reply text in (as it streams), content and :class:`ToolCall` pieces out.

    :meth:`feed` returns what is settled: strings (content) and calls, in order; text that may
    still turn out to be a tag, and whitespace that may turn out to sit next to a call, is held
    back. :meth:`finish` returns the rest. Joining every string piece gives the content of the
    whole reply, the same either way it was fed.
    """

    def __init__(self) -> None:
        self._buf = ""            # outside a block: unsent text; inside: the block's body
        self._in_call = False
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

    def _call(self, call: ToolCall, out: list) -> None:
        self.calls.append(call)
        self._space, self._after_call = "", True   # whitespace around a call is not content
        out.append(call)

    def feed(self, text: str) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
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
                self._in_call = True
            else:
                end = self._buf.find(TOOL_CALL_END)
                if end < 0:
                    return out
                body = self._buf[:end]
                self._buf = self._buf[end + len(TOOL_CALL_END):]
                self._in_call = False
                call = parse_call(body)
                if call is None:                  # not a call: the block is content as it was
                    self._content(TOOL_CALL_START + body + TOOL_CALL_END, out)
                else:
                    self._call(call, out)

    def finish(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        if self._in_call:
            call = parse_call(self._buf)          # the reply ended before </tool_call>
            if call is not None:
                self._call(call, out)
            else:
                self._content(TOOL_CALL_START + self._buf, out)
        elif self._buf:
            self._content(self._buf, out)
        self._buf, self._in_call = "", False
        if self._space and not self.calls:
            out.append(self._space)
        self._space = ""
        return out


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply: its content and its calls (as :class:`ToolCallParser` streams them)."""
    p = ToolCallParser()
    pieces = p.feed(text) + p.finish()
    return "".join(x for x in pieces if isinstance(x, str)), p.calls
