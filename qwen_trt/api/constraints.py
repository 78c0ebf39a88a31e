"""Constrained replies on the wire: ``response_format`` and ``tool_choice`` (required / named)
become one :class:`~qwen_trt.params.Grammar` in ``SamplingParams.grammar``.

* ``{"type": "text"}`` (or none): unconstrained;
* ``{"type": "json_object"}``: the reply is one JSON object;
* ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``: the reply is JSON
  valid for ``schema`` (enforced whether ``strict`` is true or false; without a schema it is
  ``json_object``);
* ``tool_choice`` required / named: see :mod:`qwen_trt.api.tools`.

The engine's grammar module (:mod:`qwen_trt.fast.step.grammar`) checks a grammar before it is
submitted (:func:`check`): a schema it cannot compile is a 400 naming the problem. An engine
without that module cannot constrain a reply, so such requests are a 400 too rather than an
unconstrained reply.
"""
from __future__ import annotations

import importlib
import json
from collections.abc import Mapping

from qwen_trt.api.errors import ApiError
from qwen_trt.errors import first_line
from qwen_trt.params import Grammar

NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _bad(message: str, param: str = "response_format") -> ApiError:
    return ApiError(400, message, param=param)


def parse_response_format(obj: Mapping) -> Grammar | None:
    rf = obj.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _bad("'response_format' must be {\"type\": \"text\" | \"json_object\" | "
                   "\"json_schema\", ...}.")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind != "json_schema":
        raise _bad(f"'response_format.type' must be text, json_object or json_schema, got "
                   f"{kind[:40]!r}.", "response_format.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise _bad("'response_format.json_schema' must be an object with a name and a schema.",
                   "response_format.json_schema")
    name = js.get("name")
    if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= 64
                             or not set(name) <= NAME_CHARS):
        raise _bad("'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' "
                   "or '-'.", "response_format.json_schema.name")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("'response_format.json_schema.strict' must be true or false.",
                   "response_format.json_schema.strict")
    schema = js.get("schema")
    if schema is None:
        return Grammar("json_object")
    if not isinstance(schema, dict):
        raise _bad("'response_format.json_schema.schema' must be a JSON schema object.",
                   "response_format.json_schema.schema")
    return Grammar("json_schema", json.dumps(schema, ensure_ascii=False))


def grammar_module():
    """The engine's grammar module, or None where this build has none."""
    try:
        return importlib.import_module("qwen_trt.fast.step.grammar")
    except ImportError:
        return None


def check(grammar: Grammar | None, param: str) -> None:
    """400 when the engine cannot apply ``grammar`` (a bad schema, or no grammar support)."""
    if grammar is None:
        return
    mod = grammar_module()
    if mod is None:
        raise ApiError(400, f"'{param}' needs constrained decoding, which this server's engine "
                            "does not have.", param=param, code="unsupported_parameter")
    try:
        mod.check_grammar(grammar)
    except ValueError as e:
        line = first_line(e) or "invalid"
        raise ApiError(400, f"'{param}': {line}", param=param) from e


def check_backend(info, grammar: Grammar | None, grammar_param: str,
                  logprobs: int | None) -> None:
    """400 when the backend cannot honour what the request asks (``BackendInfo.grammar`` /
    ``.logprobs``: e.g. TensorRT-LLM takes neither), before anything is submitted."""
    if grammar is not None and not getattr(info, "grammar", False):
        raise ApiError(400, f"'{grammar_param}' needs constrained decoding, which the "
                            f"{info.name} backend does not do (the torch backend does).",
                       param=grammar_param, code="unsupported_parameter")
    if logprobs is not None and not getattr(info, "logprobs", False):
        raise ApiError(400, f"'logprobs' is not reported by the {info.name} backend (the torch "
                            "backend reports it).", param="logprobs",
                       code="unsupported_parameter")
