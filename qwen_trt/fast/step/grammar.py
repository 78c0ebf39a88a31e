"""Constrained decoding with xgrammar: a per-request token mask applied before sampling.

* :func:`~qwen_trt.grammar_limits.check_limits` measures a spec before any xgrammar work
  (bytes, nesting depth, enum values: ``GrammarLimits``); :func:`build_grammar` calls it first.
* :func:`check_grammar` checks a :class:`~qwen_trt.params.Grammar` without a tokenizer (the
  API runs it in a checker process, :mod:`qwen_trt.api.grammar_check`, within
  ``GrammarLimits.budget_s``, to answer 400 before submitting): a bad schema is a one-line
  ``GrammarError`` (a ``ValueError``).
* :class:`GrammarBook` (one per loaded tokenizer) compiles grammars against the vocabulary on
  its own threads (xgrammar lets go of the interpreter while it works), waiting at most the
  budget; it keeps the compiled ones, and the refusals, by the spec's SHA-256 (bounded), and
  hands out one :class:`Constraint` per request. :func:`compile_in_background` runs the whole
  lookup off the caller's thread: the engine's step never waits for a compile.
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
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from qwen_trt.grammar_limits import GrammarError, GrammarLimits, check_limits, grammar_key
from qwen_trt.params import Grammar

__all__ = ["GrammarError", "GrammarLimits", "check_limits", "grammar_key", "check_grammar",
           "build_grammar", "GrammarBook", "Constraint", "grammar_book", "compile_in_background"]

CACHE_SIZE = 64                 # compiled grammars (and refusals) kept per tokenizer
COMPILE_THREADS = 2             # a book's compile threads (a runaway compile holds one)
CLOSE_SLACK = 16                # closing starts this many tokens before the closing distance
GROWTH = 2                      # what one token usually adds to the closing distance...
CHECK_EVERY = 8                 # ...but a forced literal can add many: measure this often at least
SHORTEST_CAP = 1024             # the shortest reply is measured up to this many tokens
# Closing tiers, most preferred first (the first with an allowed token wins); which list
# applies depends on whether the reply is inside a JSON string (:class:`_Scan`). In a string:
# text that ends it (and maybe more). Elsewhere: text that ends objects/arrays; separators (the
# next required key or item); a whole short value; an opener; digits and closers. The stop ids
# are in every tier; with no tier allowed, any allowed token (a key's or an enum's next letter).
_CLOSERS = set('"}],:0123456789')
_SHORT = {"{}", "[]", '""', "0", "null", "true", "false", *"123456789"}
_IN_STRING = (
    lambda t: t[0] == '"' and set(t) <= set('"}],:'),
)
_OUTSIDE = (
    lambda t: set(t) <= set("}]"),
    lambda t: set(t) <= set(",:"),
    lambda t: t in _SHORT,
    lambda t: t in ("{", "[", '"'),
    lambda t: set(t) <= _CLOSERS,
)
_XGR_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")


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


def build_grammar(grammar: Grammar, limits: GrammarLimits | None = None):
    """The xgrammar ``Grammar`` for ``grammar`` (no tokenizer needed); a one-line
    ``GrammarError`` when the spec is bad or past a limit (:func:`check_limits`, first)."""
    check_limits(grammar, limits)
    if grammar.kind == "json_object":
        return _schema_grammar({"type": "object"}, "json_object", strict=False)
    if grammar.kind == "json_schema":
        return _schema_grammar(_json_spec(grammar.spec, "the JSON schema"), "the JSON schema",
                               strict=True)
    return _tool_calls_grammar(grammar.spec)


def check_grammar(grammar: Grammar, limits: GrammarLimits | None = None) -> None:
    """Raise ``GrammarError`` (a ``ValueError``; one line naming the problem) unless
    ``grammar`` is within the limits and builds. It may take long (for a spec within the
    limits, seconds): the API runs it in a checker process, never on its event loop."""
    build_grammar(grammar, limits)


class _Scan:
    """Whether the text so far ends inside a JSON string (the closing tiers differ there): a
    byte scan of each accepted token (quotes, backslashes; the tool-call wrapper's literal
    text has balanced quotes)."""

    __slots__ = ("in_string", "escaped")

    def __init__(self, in_string: bool = False, escaped: bool = False) -> None:
        self.in_string = in_string
        self.escaped = escaped

    def copy(self) -> "_Scan":
        return _Scan(self.in_string, self.escaped)

    def feed(self, raw: bytes) -> None:
        for b in raw:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif b == 0x5C:
                    self.escaped = True
                elif b == 0x22:
                    self.in_string = False
            elif b == 0x22:
                self.in_string = True


class Constraint:
    """One request's grammar state: the allowed-token mask for the next step, and the tokens
    accepted so far. ``max_new_tokens`` is the request's budget (see :meth:`fill`); a budget
    that cannot hold the shortest reply the grammar allows (as the closing mode writes it) is a
    ``GrammarError`` here, before any token."""

    def __init__(self, book: "GrammarBook", compiled, max_new_tokens: int) -> None:
        self._book = book
        self._matcher = _xgr().GrammarMatcher(compiled)
        self._host = torch.full((1, book.width), -1, dtype=torch.int32)
        self._scan = _Scan()
        self._path: list[int] | None = None   # the closing path from here, while followed
        self._path_cap = 0
        self.max_new_tokens = max_new_tokens
        self.generated = 0
        self.closing = False
        self._distance = 0
        self._longest = 0
        self._next_check = 0
        shortest = self._closing_distance(min(max_new_tokens, SHORTEST_CAP) + 1)
        if shortest > max_new_tokens:
            raise GrammarError(f"max_tokens ({max_new_tokens}) cannot hold the shortest reply "
                               f"this grammar allows ({shortest} tokens); raise max_tokens")
        self.shortest = shortest

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
        up with the budget), it keeps only the allowed tokens of the first closing tier that
        has any (inside a string: a closing quote; elsewhere ``}``/``]``, then ``,``/``:``,
        then a short whole value, an opener, digits; the end of turn is in every tier), else
        all allowed ones; and once the closing path needs every token left, only that path's
        next token: the reply ends complete instead of being cut."""
        row = self._allowed(self._matcher, self._host)
        if self._should_close() or self._end_now(row):
            row = self._narrow(row, self._scan)
            left = self.max_new_tokens - self.generated
            if self._closing_distance(left + 1) >= left - 1:
                tok = _first_bit(row)          # the closing path's own next token, alone
                if tok is not None:
                    row = torch.zeros_like(row)
                    row[tok // 32] = _bit(tok % 32)
        if out is None:
            return row.clone()
        out.copy_(row)
        return out

    def _allowed(self, matcher, host: torch.Tensor) -> torch.Tensor:
        matcher.fill_next_token_bitmask(host, 0)
        return host[0] & self._book.allowed

    def _narrow(self, row: torch.Tensor, scan: _Scan) -> torch.Tensor:
        tiers = self._book.string_tiers if scan.in_string else self._book.tiers
        for tier in tiers:
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
        fork of the matcher, always taking the first token closing mode allows. The path is
        kept while the reply follows it (the same policy from the same state: the same path),
        so forced closing measures it once."""
        if self._path is not None and (len(self._path) <= cap or self._path_cap >= cap):
            return min(len(self._path), cap)
        m = self._matcher.fork()
        scan = self._scan.copy()
        host = torch.empty_like(self._host)
        stops = self._book.stop_ids
        texts = self._book.token_bytes
        path: list[int] = []
        for _ in range(cap):
            tok = _first_bit(self._narrow(self._allowed(m, host), scan))
            path.append(-1 if tok is None else tok)
            if tok is None or tok in stops or not m.accept_token(tok) or m.is_terminated():
                self._path, self._path_cap = path, cap
                return len(path)
            scan.feed(texts[tok])
        self._path, self._path_cap = None, 0          # cut at cap: not a whole path
        return cap

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar does not allow it."""
        self.generated += 1
        path = self._path
        self._path = path[1:] if path and path[0] == int(token) else None
        ok = bool(self._matcher.accept_token(int(token)))
        if ok:
            self._scan.feed(self._book.token_bytes[int(token)])
        return ok


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
        # by grammar_key: a compiled grammar, or the GrammarError that refused it
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="qwen-trt-grammar")
        self._lock = threading.Lock()
        stops = set(self._info.stop_token_ids)
        self.stop_ids = frozenset(stops)
        self.token_bytes: list[bytes] = list(self._info.decoded_vocab)   # by token id
        self.tiers = tuple(self._tier(keep, stops) for keep in _OUTSIDE)
        self.string_tiers = tuple(self._tier(keep, stops) for keep in _IN_STRING)
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
            chars = _CLOSERS | set("{[nulltrefas")
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

    def compile(self, grammar: Grammar, limits: GrammarLimits | None = None):
        """The compiled grammar (cached by :func:`grammar_key`); ``GrammarError`` for a bad
        spec, one past a limit, or one that does not compile within ``limits.budget_s`` (the
        compile goes on on its thread and is kept if it ends; a refusal is kept too, so the
        same spec again is answered at once)."""
        lim = limits or GrammarLimits.from_settings()
        key = grammar_key(grammar)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                if isinstance(hit, GrammarError):
                    raise GrammarError(str(hit))
                return hit
            fut = self._pending.get(key)
            if fut is None:
                fut = self._pending[key] = self._pool.submit(self._build, grammar, key, lim)
        try:
            return fut.result(timeout=lim.budget_s)
        except FutureTimeout:
            err = GrammarError(f"the {grammar.kind} grammar did not compile within "
                               f"{lim.budget_s:g} s (QWEN_TRT_GRAMMAR_BUDGET_S)")
            with self._lock:
                if key in self._pending:       # still running: refuse it until it ends
                    self._keep(key, err)
            raise err from None

    def _build(self, grammar: Grammar, key: str, limits: GrammarLimits):
        try:
            source = build_grammar(grammar, limits)
            try:
                compiled = self._compiler.compile_grammar(source)
            except Exception as e:  # noqa: BLE001
                raise GrammarError(f"the {grammar.kind} grammar does not compile: "
                                   f"{_one_line(e)}") from None
        except GrammarError as e:
            with self._lock:
                self._pending.pop(key, None)
                self._keep(key, e)
            raise
        with self._lock:
            self._pending.pop(key, None)
            self._keep(key, compiled)
        return compiled

    def _keep(self, key: str, value) -> None:
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)

    def constraint(self, grammar: Grammar, max_new_tokens: int) -> Constraint:
        return Constraint(self, self.compile(grammar), max_new_tokens)


def _bit(j: int) -> int:
    """Bit ``j`` of an int32 word, as the signed value torch stores."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j


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


_BOOK_LOCK = threading.Lock()


def grammar_book(owner, tokenizer, vocab_size: int, stop_ids: Collection[int]) -> GrammarBook:
    """``owner``'s :class:`GrammarBook`, built on first use (kept as ``owner._grammar_book``)."""
    book = getattr(owner, "_grammar_book", None)
    if book is None:
        with _BOOK_LOCK:
            book = getattr(owner, "_grammar_book", None)
            if book is None:
                book = GrammarBook(tokenizer, vocab_size, stop_ids)
                owner._grammar_book = book
    return book


_BACKGROUND: ThreadPoolExecutor | None = None


def compile_in_background(books: Callable[[], GrammarBook], grammar: Grammar) -> Future:
    """A Future of ``books().compile(grammar)`` run on a side thread (building the book, which
    reads the whole vocabulary, included): the engine's step polls it instead of waiting. It
    ends within the budget (a ``GrammarError`` then) once the book exists."""
    global _BACKGROUND
    with _BOOK_LOCK:
        if _BACKGROUND is None:
            _BACKGROUND = ThreadPoolExecutor(COMPILE_THREADS,
                                             thread_name_prefix="qwen-trt-grammar-prep")
    return _BACKGROUND.submit(lambda: books().compile(grammar))
