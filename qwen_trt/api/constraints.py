"""Constrained replies on the wire: ``response_format`` and ``tool_choice`` (required / named)
become one :class:`~qwen_trt.params.Grammar` in ``SamplingParams.grammar``.

* ``{"type": "text"}`` (or none): unconstrained;
* ``{"type": "json_object"}``: the reply is one JSON object;
* ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``: the reply is JSON
  valid for ``schema`` (enforced whether ``strict`` is true or false; without a schema it is
  ``json_object``);
* ``tool_choice`` required / named: see :mod:`qwen_trt.api.tools`.

A grammar is checked before it is submitted (:func:`check`): a schema the engine cannot
compile is a 400 naming the problem. The size limits come first, on the event loop (cheap:
bytes, depth, enum values; :mod:`qwen_trt.grammar_limits`), then xgrammar's own check in a
checker process (:mod:`qwen_trt.api.grammar_check`: this process never imports torch or
xgrammar, and the loop, ``/health`` included, keeps answering) within the time budget
(``QWEN_TRT_GRAMMAR_BUDGET_S``): a spec that takes longer is a 400 naming the budget, and its
checker is killed. Verdicts are kept by the spec's SHA-256 (:data:`VERDICTS` of them), and a
spec being checked is checked once however many requests send it. An install without xgrammar
cannot constrain a reply, so such requests are a 400 too rather than an unconstrained reply.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from qwen_trt.api.errors import ApiError
from qwen_trt.errors import first_line
from qwen_trt.grammar_limits import GrammarLimits, check_limits, grammar_key
from qwen_trt.params import Grammar

CHECK_THREADS = 8          # checks waiting for a checker process at once
VERDICTS = 256             # verdicts kept: "" (passes) or the 400's line

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


def checker(tokenizer_source: str | None = None):
    """Where grammars are checked: the checker processes (:mod:`qwen_trt.api.grammar_check`;
    with the served tokenizer's folder they also compile and measure the shortest reply), or
    None where this install cannot constrain (no xgrammar). Found without importing it."""
    if importlib.util.find_spec("xgrammar") is None:
        return None
    from qwen_trt.api.grammar_check import pool

    return pool(tokenizer_source)


def tokenizer_folder(tokenizer) -> str | None:
    """The folder ``tokenizer`` was loaded from, when it is one (a checker loads it again)."""
    path = getattr(tokenizer, "name_or_path", None)
    return path if isinstance(path, str) and path and os.path.isdir(path) else None


_lock = threading.Lock()
Key = tuple[int, str, float]     # (the checker pool, the spec's SHA-256, the budget)
_verdicts: OrderedDict[Key, tuple[str, int | None]] = OrderedDict()
_running: dict[Key, Future] = {}
_threads: ThreadPoolExecutor | None = None


def _keep(key: Key, verdict: tuple[str, int | None]) -> None:
    with _lock:
        _verdicts[key] = verdict
        _verdicts.move_to_end(key)
        while len(_verdicts) > VERDICTS:
            _verdicts.popitem(last=False)


def _start(pool, grammar: Grammar, key: Key, limits: GrammarLimits) -> Future:
    """The check of ``grammar`` (one per spec at a time), on a thread that waits for its
    checker; its result: the verdict, or a CheckerBusy / CheckerTimeout."""
    global _threads
    with _lock:
        got = _running.get(key)
        if got is not None:
            return got
        if _threads is None:
            _threads = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="qwen-trt-grammar")

        def run() -> tuple[str, int | None]:
            try:
                verdict = pool.verdict(grammar.kind, grammar.spec, limits)
            finally:
                with _lock:
                    _running.pop(key, None)
            _keep(key, verdict)
            return verdict

        got = _running[key] = _threads.submit(run)
        return got


async def check(grammar: Grammar | None, param: str, tokenizer=None,
                max_tokens: int | None = None) -> None:
    """400 when the engine cannot apply ``grammar`` (a bad schema, one past a size limit or
    the time budget, or no grammar support), or when ``max_tokens`` cannot hold the shortest
    reply it allows (measured on ``tokenizer``'s vocabulary, when it is a folder); 503 when no
    checker is free within the budget. The event loop only measures the size limits; xgrammar
    runs in a checker process."""
    if grammar is None:
        return
    pool = checker(tokenizer_folder(tokenizer))
    if pool is None:
        raise ApiError(400, f"'{param}' needs constrained decoding, which this server's engine "
                            "does not have.", param=param, code="unsupported_parameter")
    from qwen_trt.api.grammar_check import CheckerBusy, CheckerTimeout, CheckerUnavailable

    try:
        limits = GrammarLimits.from_settings()
        check_limits(grammar, limits)              # before any xgrammar work
    except ValueError as e:
        raise ApiError(400, f"'{param}': {first_line(e) or 'invalid'}", param=param) from e
    key = (id(pool), grammar_key(grammar), limits.budget_s)
    with _lock:
        verdict = _verdicts.get(key)
    if verdict is None:
        try:
            verdict = await asyncio.wrap_future(_start(pool, grammar, key, limits))
        except CheckerBusy:
            raise ApiError(503, f"'{param}': every grammar checker is busy; retry.",
                           param=param, headers={"Retry-After": "1"}) from None
        except CheckerUnavailable:
            raise ApiError(503, f"'{param}': the grammar checker did not start (see the "
                                "server log); retry.", param=param,
                           headers={"Retry-After": "5"}) from None
        except CheckerTimeout:
            verdict = (f"the grammar took longer than {limits.budget_s:g} s to check "
                       f"(QWEN_TRT_GRAMMAR_BUDGET_S); use less nesting or fewer enum values",
                       None)
            _keep(key, verdict)
    line, shortest = verdict
    if line:
        raise ApiError(400, f"'{param}': {line}", param=param)
    if shortest is not None and max_tokens is not None and max_tokens < shortest:
        raise ApiError(400, f"'max_tokens' ({max_tokens}) cannot hold the shortest reply "
                            f"'{param}' allows ({shortest} tokens); raise it.",
                       param="max_tokens")


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
