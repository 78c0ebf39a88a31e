"""Constrained decoding with xgrammar: a per-request token mask applied before sampling.

* :func:`check_grammar` checks a :class:`~qwen_trt.params.Grammar` without a tokenizer (the
  API calls it to answer 400 before submitting): a bad schema is a one-line ``GrammarError``
  (a ``ValueError``).
* :class:`GrammarBook` (one per loaded tokenizer) compiles grammars against the vocabulary,
  keeping the compiled ones by ``(kind, spec)``, and hands out one :class:`Constraint` per
  request.
* :class:`Constraint` gives the bitmask of the tokens allowed next (int32 words, bit ``j`` of
  word ``i`` is token ``32 i + j``: xgrammar's layout) and accepts each generated token.

The grammars are compact: JSON without optional whitespace (so a reply cannot spend its tokens
on blanks), and a ``json_schema`` only generates the properties it names (xgrammar's strict
mode; the output still validates). Near the end of ``max_new_tokens`` a constraint closes the
value it is in (:meth:`Constraint.fill`), so a reply that would have been cut mid-value parses.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Collection

import torch

from qwen_trt.errors import QwenTrtError
from qwen_trt.params import Grammar

CACHE_SIZE = 64                 # compiled grammars kept per tokenizer
CLOSE_SLACK = 16                # closing starts this many tokens before the closing distance
GROWTH = 2                      # what one token usually adds to the closing distance...
CHECK_EVERY = 8                 # ...but a forced literal can add many: measure this often at least
# Closing tiers, most preferred first (the first with an allowed token wins): text that
# ends a string (and maybe more); that ends objects/arrays; separators (a number ends, the next
# required key or value starts); digits (a number value). The stop ids are in every tier.
_TIERS = (
    lambda t: t[0] == '"' and set(t) <= set('"}]'),
    lambda t: set(t) <= set('}]'),
    lambda t: set(t) <= set(',:"'),
    lambda t: set(t) <= set('"}],:0123456789'),
)
_XGR_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")


class GrammarError(QwenTrtError, ValueError):
    """A grammar that cannot be used (bad schema, unsupported keyword), or a token it rejects."""


def _xgr():
    import xgrammar

    return xgrammar


def _one_line(e: BaseException, limit: int = 200) -> str:
    text = _XGR_PREFIX.sub("", str(e).strip()).splitlines()
    return (text[0] if text else type(e).__name__)[:limit]


def _json_spec(text: str, what: str):
    try:
        return json.loads(text)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"{what} is not valid JSON ({_one_line(e, 80)})") from None


def _schema_grammar(schema, what: str, *, strict: bool):
    xgr = _xgr()
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{what} must be a JSON object")
    try:
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                            strict_mode=strict)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for any bad schema
        raise GrammarError(f"{what} is not supported: {_one_line(e)}") from None


def _tools(spec: str) -> tuple[list[tuple[str, object]], bool]:
    d = _json_spec(spec, "the tool_calls grammar spec")
    tools = d.get("tools") if isinstance(d, dict) else None
    if not isinstance(tools, list) or not tools:
        raise GrammarError('the tool_calls grammar spec needs a non-empty "tools" list')
    parallel = d.get("parallel", False)
    if not isinstance(parallel, bool):
        raise GrammarError('the tool_calls grammar spec\'s "parallel" must be true or false')
    out = []
    for t in tools:
        name = t.get("name") if isinstance(t, dict) else None
        if not isinstance(name, str) or not name:
            raise GrammarError("each tool needs a non-empty string name")
        params = t.get("parameters")
        if params is None:
            params = {"type": "object"}
        out.append((name, params))
    return out, parallel


def _tool_calls_grammar(spec: str):
    """``<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>`` for one of the tools (one or
    more, newline-separated, when parallel), as an xgrammar structural tag."""
    xgr = _xgr()
    from xgrammar import structural_tag as st

    tools, parallel = _tools(spec)
    calls = []
    for name, params in tools:
        what = f"the parameters of tool {name[:40]!r}"
        if not isinstance(params, dict):
            raise GrammarError(f"{what} must be a JSON object")
        # the compact JSON grammar of the arguments, embedded as EBNF (a json_schema element
        # of a structural tag allows whitespace)
        args = str(_schema_grammar(params, what, strict=True))
        calls.append(st.SequenceFormat(elements=[
            st.ConstStringFormat(value='<tool_call>\n{"name": ' + json.dumps(name)
                                 + ', "arguments": '),
            st.GrammarFormat(grammar=args),
            st.ConstStringFormat(value="}\n</tool_call>")]))
    one = calls[0] if len(calls) == 1 else st.OrFormat(elements=calls)
    fmt = one if not parallel else st.SequenceFormat(elements=[
        one, st.StarFormat(content=st.SequenceFormat(elements=[
            st.ConstStringFormat(value="\n"), one]))])
    try:
        return xgr.Grammar.from_structural_tag(st.StructuralTag(format=fmt))
    except Exception as e:  # noqa: BLE001
        raise GrammarError(f"the tool_calls grammar is not supported: {_one_line(e)}") from None


def build_grammar(grammar: Grammar):
    """The xgrammar ``Grammar`` for ``grammar`` (no tokenizer needed); a one-line
    ``GrammarError`` when the spec is bad."""
    if grammar.kind == "json_object":
        return _schema_grammar({"type": "object"}, "json_object", strict=False)
    if grammar.kind == "json_schema":
        return _schema_grammar(_json_spec(grammar.spec, "the JSON schema"), "the JSON schema",
                               strict=True)
    return _tool_calls_grammar(grammar.spec)


def check_grammar(grammar: Grammar) -> None:
    """Raise ``GrammarError`` (a ``ValueError``; one line naming the problem) unless
    ``grammar`` compiles."""
    build_grammar(grammar)


class Constraint:
    """One request's grammar state: the allowed-token mask for the next step, and the tokens
    accepted so far. ``max_new_tokens`` is the request's budget (see :meth:`fill`)."""

    def __init__(self, book: "GrammarBook", compiled, max_new_tokens: int) -> None:
        self._book = book
        self._matcher = _xgr().GrammarMatcher(compiled)
        self._host = torch.full((1, book.width), -1, dtype=torch.int32)
        self.max_new_tokens = max_new_tokens
        self.generated = 0
        self.closing = False
        self._distance = 0
        self._longest = 0
        self._next_check = 0

    @property
    def width(self) -> int:
        return self._book.width

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The mask of the tokens allowed next (int32 ``[width]``), written into ``out`` (a host
        tensor) when given.

        Closing mode: once the budget left is about what closing every open value takes
        (plus ``CLOSE_SLACK``; measured again only as often as the distance could have caught
        up with the budget), it keeps only the allowed tokens of the first
        closing tier that has any (a closing quote, then ``}``/``]``, then ``,``/``:``, then
        digits; the end of turn is in every tier), else all allowed ones: the reply ends
        complete instead of being cut."""
        row = self._allowed(self._matcher, self._host)
        if self._should_close() or self._end_now(row):
            row = self._narrow(row)
        if out is None:
            return row.clone()
        out.copy_(row)
        return out

    def _allowed(self, matcher, host: torch.Tensor) -> torch.Tensor:
        matcher.fill_next_token_bitmask(host, 0)
        return host[0] & self._book.allowed

    def _narrow(self, row: torch.Tensor) -> torch.Tensor:
        for tier in self._book.tiers:
            narrowed = row & tier
            if bool(narrowed.any()):
                return narrowed
        return row

    def _end_now(self, row: torch.Tensor) -> bool:
        """The reply may end here (a stop id is allowed), and another round of what it wrote
        (the next parallel tool call, say: as long as the longest closing distance seen)
        would not fit in the budget left: end it now."""
        left = self.max_new_tokens - self.generated
        if left > self._longest + CLOSE_SLACK or not bool((row & self._book.stop_mask).any()):
            return False
        self.closing = True
        return True

    def _should_close(self) -> bool:
        if self.closing:
            return True
        left = self.max_new_tokens - self.generated
        if self.generated >= self._next_check:
            self._distance = self._closing_distance(left)
            self._longest = max(self._longest, self._distance)
            # the distance grows by about GROWTH per token: measure again before it could
            # reach the budget left, and every CHECK_EVERY tokens anyway (a token that opens a
            # forced literal, e.g. the next parallel tool call, adds its whole length)
            room = left - self._distance - CLOSE_SLACK
            self._next_check = self.generated + max(1, min(CHECK_EVERY, room // (GROWTH + 1)))
        self.closing = left <= self._distance + CLOSE_SLACK
        return self.closing

    def _closing_distance(self, cap: int) -> int:
        """Tokens the closing mode takes to end the reply from here (at most ``cap``), on a
        fork of the matcher, always taking the first token closing mode allows."""
        m = self._matcher.fork()
        host = torch.empty_like(self._host)
        stops = self._book.stop_ids
        for n in range(1, cap + 1):
            tok = _first_bit(self._narrow(self._allowed(m, host)))
            if tok is None or tok in stops or not m.accept_token(tok) or m.is_terminated():
                return n
        return cap

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar does not allow it."""
        self.generated += 1
        return bool(self._matcher.accept_token(int(token)))


class GrammarBook:
    """Grammars compiled against one tokenizer's vocabulary (``vocab_size``: the logits'
    width, which may exceed the tokenizer's; ``stop_ids``: the ids that end a turn)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Collection[int]) -> None:
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.width = (vocab_size + 31) // 32
        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids) or None)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=2)
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        stops = set(self._info.stop_token_ids)
        self.stop_ids = frozenset(stops)
        self.tiers = tuple(self._tier(keep, stops) for keep in _TIERS)
        self.stop_mask = self._tier(lambda t: False, stops)
        # Special tokens (<|im_start|>, ...) are never text of a constrained reply; the stop
        # ids end it.
        specials = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                    if getattr(t, "special", False) and i < vocab_size} - stops
        banned = torch.zeros(self.width * 32, dtype=torch.bool)
        banned[sorted(specials)] = True
        banned[vocab_size:] = True             # the bits past the vocabulary in the last word
        self.allowed = ~pack_mask(banned)

    def _tier(self, keep, stops: set[int]) -> torch.Tensor:
        """A mask of the tokens whose text passes ``keep``, plus the stop ids."""
        allowed = torch.zeros(self.width * 32, dtype=torch.bool)
        for i, text in self._closing_texts():
            if keep(text):
                allowed[i] = True
        for i in stops:
            allowed[i] = True
        return pack_mask(allowed)

    def _closing_texts(self) -> list[tuple[int, str]]:
        """(id, text) of the tokens made only of the closing tiers' characters (one pass over
        the vocabulary, kept)."""
        if getattr(self, "_texts", None) is None:
            chars = set('"}],:0123456789')
            special = set(self._info.special_token_ids)
            self._texts = []
            for i, raw in enumerate(self._info.decoded_vocab[:self.vocab_size]):
                if i in special or not raw or len(raw) > 16:
                    continue
                try:
                    text = bytes(raw).decode("utf-8")
                except UnicodeDecodeError:
                    continue
                if text and set(text) <= chars:
                    self._texts.append((i, text))
        return self._texts

    def compile(self, grammar: Grammar):
        """The compiled grammar (cached by ``(kind, spec)``); ``GrammarError`` for a bad spec."""
        key = (grammar.kind, grammar.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        source = build_grammar(grammar)
        try:
            compiled = self._compiler.compile_grammar(source)
        except Exception as e:  # noqa: BLE001
            raise GrammarError(f"the {grammar.kind} grammar does not compile: {_one_line(e)}") \
                from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def constraint(self, grammar: Grammar, max_new_tokens: int) -> Constraint:
        return Constraint(self, self.compile(grammar), max_new_tokens)


def _first_bit(words: torch.Tensor) -> int | None:
    """The lowest token id set in an int32 bitmask row, or None."""
    nz = torch.nonzero(words)
    if not len(nz):
        return None
    i = int(nz[0, 0])
    w = int(words[i]) & 0xFFFFFFFF
    return 32 * i + (w & -w).bit_length() - 1


def pack_mask(allowed: torch.Tensor) -> torch.Tensor:
    """bool ``[..., 32 w]`` -> int32 ``[..., w]`` in xgrammar's bit layout."""
    bits = allowed.view(*allowed.shape[:-1], -1, 32).to(torch.int64)
    words = (bits << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def grammar_book(owner, tokenizer, vocab_size: int, stop_ids: Collection[int]) -> GrammarBook:
    """``owner``'s :class:`GrammarBook`, built on first use (kept as ``owner._grammar_book``)."""
    book = getattr(owner, "_grammar_book", None)
    if book is None:
        book = GrammarBook(tokenizer, vocab_size, stop_ids)
        owner._grammar_book = book
    return book
