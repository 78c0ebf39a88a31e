"""What a constrained-decoding grammar may cost, measured before any xgrammar work.

xgrammar's time grows about with the cube of a JSON schema's nesting depth and faster than
linearly in its enum values (4,500 enum strings: seconds; 100,000: minutes), so a spec is
measured first (its bytes before it is parsed, then its depth and enum values) and refused in
one line naming the limit it passes: :class:`GrammarLimits` (its settings: ``_LIMIT_VARS``). No
torch, no xgrammar here: the API's process checks limits without loading either
(:mod:`qwen_trt.api.constraints`), the engine before it compiles
(:mod:`qwen_trt.fast.step.grammar`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from qwen_trt import settings
from qwen_trt.errors import QwenTrtError
from qwen_trt.params import Grammar


class GrammarError(QwenTrtError, ValueError):
    """A grammar that cannot be used (bad schema, unsupported keyword, past a limit or the time
    budget), or a token it rejects."""


@dataclass(frozen=True)
class GrammarLimits:
    """What a grammar may cost (module docstring). Each is > 0; :meth:`from_settings` reads
    ``QWEN_TRT_GRAMMAR_MAX_BYTES`` / ``_MAX_DEPTH`` / ``_MAX_ENUM`` / ``_BUDGET_S``."""

    max_bytes: int = 65536       # the spec's UTF-8 bytes (a tool_calls spec: all its schemas)
    max_depth: int = 64          # objects and arrays nested in one schema document
    max_enum: int = 4096         # enum values plus consts, all the spec's schemas together
    budget_s: float = 5.0        # seconds to check (API) or compile (engine)

    def __post_init__(self) -> None:
        for name, var in _LIMIT_VARS.items():
            value = getattr(self, name)
            if not value > 0 or value != value or value == float("inf"):
                raise settings.SettingError(f"{var} must be a number > 0, got {value!r}")

    @classmethod
    def from_settings(cls, environ=None) -> "GrammarLimits":
        return cls(**{name: settings.get(var, environ) for name, var in _LIMIT_VARS.items()})


_LIMIT_VARS = {"max_bytes": "QWEN_TRT_GRAMMAR_MAX_BYTES",
               "max_depth": "QWEN_TRT_GRAMMAR_MAX_DEPTH",
               "max_enum": "QWEN_TRT_GRAMMAR_MAX_ENUM",
               "budget_s": "QWEN_TRT_GRAMMAR_BUDGET_S"}


def _size(n: int) -> str:
    return f"{n} bytes" if n < 10 * 1024 else f"{n / 1024:.0f} KiB"


def _depth_and_enums(doc, max_depth: int) -> tuple[int, int]:
    """The nesting depth of ``doc`` (objects and arrays; stops counting past ``max_depth``)
    and its enum values plus consts, without recursion."""
    depth, enums = 0, 0
    stack = [(doc, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            items = node.values()
            enum = node.get("enum")
            if isinstance(enum, list):
                enums += len(enum)
            if "const" in node and not isinstance(node.get("const"), dict):
                enums += 1
        elif isinstance(node, list):
            items = node
        else:
            continue
        depth = max(depth, d)
        if depth > max_depth:
            return depth, enums
        stack.extend((x, d + 1) for x in items if isinstance(x, (dict, list)))
    return depth, enums


def check_limits(grammar: Grammar, limits: GrammarLimits | None = None) -> None:
    """``GrammarError`` naming the limit when ``grammar``'s spec is too large, too deep or has
    too many enum values (cheap: no xgrammar; the bytes are measured before parsing)."""
    lim = limits or GrammarLimits.from_settings()
    if grammar.kind == "json_object":
        return
    one = grammar.kind == "json_schema"
    what, is_, nests, lists = (("the JSON schema", "is", "nests", "lists") if one else
                               ("the tools' schemas", "are", "nest", "list"))
    n = len(grammar.spec.encode("utf-8", "surrogatepass"))
    if n > lim.max_bytes:
        raise GrammarError(f"{what} {is_} {_size(n)}; the limit is {_size(lim.max_bytes)} "
                           f"(QWEN_TRT_GRAMMAR_MAX_BYTES)")
    try:
        doc = json.loads(grammar.spec)
    except RecursionError:
        doc = None
        depth = lim.max_depth + 1
    except (TypeError, ValueError):
        return                       # build_grammar names the JSON error
    if doc is not None:
        docs = [doc]
        if grammar.kind == "tool_calls" and isinstance(doc, dict) and \
                isinstance(doc.get("tools"), list):
            docs = [t.get("parameters") for t in doc["tools"] if isinstance(t, dict)]
        depth, enums = 0, 0
        for d in docs:
            dd, de = _depth_and_enums(d, lim.max_depth)
            depth, enums = max(depth, dd), enums + de
        if enums > lim.max_enum:
            raise GrammarError(f"{what} {lists} {enums} enum values and consts; the limit is "
                               f"{lim.max_enum} (QWEN_TRT_GRAMMAR_MAX_ENUM)")
    if depth > lim.max_depth:
        raise GrammarError(f"{what} {nests} objects and arrays more than {lim.max_depth} deep "
                           f"(the limit, QWEN_TRT_GRAMMAR_MAX_DEPTH)")


def grammar_key(grammar: Grammar) -> str:
    """The cache key of a grammar: the SHA-256 of its kind and spec."""
    h = hashlib.sha256(grammar.kind.encode())
    h.update(b"\0")
    h.update(grammar.spec.encode("utf-8", "surrogatepass"))
    return h.hexdigest()
