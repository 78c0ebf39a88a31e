"""Text the chat UI shows: model output made safe for Markdown, and the lines under replies.

Model output and user text are untrusted. :func:`sanitize_markdown` parses the text once
(markdown-it-py: CommonMark plus GFM tables and strikethrough, as Streamlit renders it) and
writes new Markdown from the parse tree in a small subset: headings, paragraphs, lists, quotes,
emphasis, strikethrough, tables, ``http(s)`` links, code spans and fenced code. Every piece of
text outside code is fully backslash-escaped (CommonMark lets any ASCII punctuation be
escaped), so no character of the input reaches the page as Markdown syntax, HTML, LaTeX (``$``)
or a Streamlit directive (``:red[...]``). Images and raw HTML come out as escaped text (nothing
is fetched), links of other schemes as their text. Code keeps its text, in fences chosen longer
than any backtick run inside.
"""
from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass

from qwen_trt.errors import first_line, QwenTrtError
from qwen_trt.params import Reply

CURSOR = "▌"

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# Every ASCII punctuation character gets a backslash: shown as written, never syntax.
_ESCAPE = str.maketrans({c: "\\" + c for c in string.punctuation})
_HTTP = re.compile(r"https?://[^\s]", re.IGNORECASE)
# Characters kept as they are in a link destination; the rest is percent-encoded.
_URL_UNSAFE = re.compile(r"[^A-Za-z0-9\-._~/?#@=&%+,;:]")
# A bare URL in text (GFM autolinks these); trailing punctuation is not part of it.
_BARE_URL = re.compile(r"(?<![A-Za-z0-9])https?://[^\s<>]+", re.IGNORECASE)
_URL_TRAIL = "?!.,:*_~'\";"
_TASK = re.compile(r"\[[ xX]\] ")
_LANG = re.compile(r"[A-Za-z0-9_+#.\-]{1,40}")
_BACKTICK_RUN = re.compile(r"`+")
# Streamlit renders a ```math fence as LaTeX: such a block gets this language instead.
_INERT_MATH_LANG = "latex"
# A list right after another of the same marker would join it: it gets the other marker.
_OTHER_MARKER = {"-": "*", "*": "-", "+": "-", ".": ")", ")": "."}
# Deeper structures are cut by the parser (their text is left out of the output).
MAX_NESTING = 100


def _escape(text: str) -> str:
    return text.translate(_ESCAPE)


def _link_target(href: str) -> str | None:
    """``href`` as a link destination if it is http(s) (percent-encoded so that nothing in it is
    Markdown syntax), else None."""
    if not _HTTP.match(href):
        return None
    href = _URL_UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), href)
    return href.replace("&", "\\&")     # "&amp;" in a destination is an entity


def _link(text_md: str, href: str) -> str:
    return f"[{text_md}]({href})"


def _bare_url_end(url: str) -> int:
    end = len(url)
    while end and (url[end - 1] in _URL_TRAIL
                   or (url[end - 1] == ")" and url.count("(", 0, end) < url.count(")", 0, end))):
        end -= 1
    return end


def _text(text: str, links: bool) -> str:
    """Escaped text; with ``links``, bare http(s) URLs become links (GFM shows them so)."""
    if not links or "://" not in text:
        return _escape(text)
    out, pos = [], 0
    for m in _BARE_URL.finditer(text):
        url = m.group()[:_bare_url_end(m.group())]
        target = _link_target(_markdown().normalizeLink(url))
        if target is None:
            continue
        out += [_escape(text[pos:m.start()]), _link(_escape(url), target)]
        pos = m.start() + len(url)
    out.append(_escape(text[pos:]))
    return "".join(out)


def _code_span(code: str, in_table: bool) -> str:
    if in_table and "|" in code:
        if re.search(r"\\\|", code):     # "\|" has no exact form in a cell: shown as text
            return _escape(code)
        code = code.replace("|", "\\|")  # GFM splits cells at "|" before finding code spans
    runs = {len(r) for r in _BACKTICK_RUN.findall(code)}
    n = 1
    while n in runs:
        n += 1
    pad = " " if code.strip(" ") and (code[0] in " `" or code[-1] in " `") else ""
    return "`" * n + pad + code + pad + "`" * n


def _plain(tokens) -> str:
    """The text of inline tokens (an image's alt text)."""
    out = []
    for t in tokens:
        if t.type in ("softbreak", "hardbreak"):
            out.append(" ")
        elif t.type == "image":
            out.append(_plain(t.children or []))
        else:
            out.append(t.content)
    return "".join(out)


def _inline(tokens, nl: str = "\n", in_table: bool = False, task: bool = False) -> str:
    """Markdown for one inline token list; ``nl`` is what a line break becomes."""
    out: list[str] = []
    # open links: (target, or None when shown as text; where its text starts in out; href)
    links: list[tuple[str | None, int, str]] = []
    strike = 0
    for i, t in enumerate(tokens):
        kind = t.type
        if kind in ("text", "text_special"):
            text = t.content
            if task and i == 0 and _TASK.match(text):     # GFM task list item: "[ ] " / "[x] "
                out.append(text[:4])
                text = text[4:]
            out.append(_text(text, links=not links))
        elif kind == "softbreak":
            out.append(nl)
        elif kind == "hardbreak":
            out.append("\\" + nl if nl == "\n" else nl)
        elif kind == "code_inline":
            out.append(_code_span(t.content, in_table))
        elif kind in ("em_open", "em_close", "strong_open", "strong_close"):
            out.append(t.markup)
        elif kind in ("s_open", "s_close"):
            strike += 1 if kind == "s_open" else -1
            if (kind == "s_open" and strike == 1) or (kind == "s_close" and strike == 0):
                out.append("~~")
        elif kind == "link_open":
            href = t.attrGet("href") or ""
            target = None if links else _link_target(href)
            if target is not None:
                out.append("[")
            links.append((target, len(out), href))
        elif kind == "link_close":
            target, start, href = links.pop() if links else (None, 0, "")
            if target is not None:
                if start == len(out):     # no text: show the address
                    out.append(_escape(href))
                out.append(f"]({target})")
        elif kind == "image":
            src = t.attrGet("src") or ""
            out.append(_escape(f"![{_plain(t.children or [])}]({src})"))
        elif kind == "html_inline":
            out.append(_escape(t.content).replace("\n", nl))
        else:                             # anything else this parser knows: as text
            out.append(_escape(t.content).replace("\n", nl))
    return "".join(out)


@dataclass
class _Box:
    """A container being written: the document, a quote, a list or a list item."""

    kind: str                     # "doc" | "quote" | "list" | "item"
    tight: bool = False
    marker: str = ""              # item: "- " or "3. "; list: its bullet or delimiter
    number: int = 1               # ordered list: the next item's number
    started: bool = False         # item: its first line is written
    last: str = ""                # the kind of the last block written in it ("" if none)
    last_list: str = ""           # the marker of the last list written in it


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.stack: list[_Box] = [_Box("doc")]

    def prefix(self) -> str:
        parts = []
        for box in self.stack:
            if box.kind == "quote":
                parts.append("> ")
            elif box.kind == "item":
                parts.append(box.marker if not box.started else " " * len(box.marker))
        return "".join(parts)

    def write(self, lines: list[str]) -> None:
        for line in lines:
            self.lines.append(self.prefix() + line)
            for box in self.stack:
                box.started = True

    def blank(self) -> None:
        self.lines.append(self.prefix().rstrip())

    def begin(self, kind: str) -> None:
        """Start a block of ``kind`` in the innermost container: a blank line before it
        where the container needs one."""
        box = self.stack[-1]
        if box.kind == "list":
            if box.last and not box.tight:
                self.blank()
        elif box.last:
            tight = box.kind == "item" and box.tight
            if (not tight or kind == "table" or box.last == "table"
                    or (kind == "paragraph" and box.last in ("paragraph", "quote", "list"))):
                self.blank()
        box.last = kind


def _tight(tokens, i: int) -> bool:
    """Whether the list opening at ``tokens[i]`` is tight (its paragraphs are hidden)."""
    depth = 0
    for t in tokens[i + 1:]:
        depth += t.nesting
        if depth < 0:
            return True
        if t.type == "paragraph_open" and depth == 2:
            return t.hidden
    return True


def _fence(code: str, lang: str) -> list[str]:
    runs = [len(r) for r in _BACKTICK_RUN.findall(code)]
    fence = "`" * max(3, max(runs, default=0) + 1)
    lang = lang.split(maxsplit=1)[0] if lang.strip() else ""
    if not _LANG.fullmatch(lang):
        lang = ""
    if lang.lower().startswith("math"):
        lang = _INERT_MATH_LANG
    body = code[:-1] if code.endswith("\n") else code
    return [fence + lang] + (body.split("\n") if code else []) + [fence]


def _table(tokens, i: int) -> tuple[list[str], int]:
    """The table starting at ``tokens[i]`` as Markdown lines, and the index after it."""
    rows: list[list[str]] = []
    aligns: list[str] = []
    j = i + 1
    while tokens[j].type != "table_close":
        t = tokens[j]
        if t.type == "tr_open":
            rows.append([])
        elif t.type in ("th_open", "td_open"):
            if t.type == "th_open":
                style = t.attrGet("style") or ""
                aligns.append({"text-align:left": ":---", "text-align:right": "---:",
                               "text-align:center": ":---:"}.get(style, "---"))
            cell = tokens[j + 1]
            rows[-1].append(_inline(cell.children or [], nl=" ", in_table=True)
                            if cell.type == "inline" else "")
        j += 1
    lines = []
    for k, row in enumerate(rows):
        lines.append("| " + " | ".join(c or " " for c in row) + " |")
        if k == 0:
            lines.append("| " + " | ".join(aligns) + " |")
    return lines, j + 1


def _html_lines(html: str) -> list[list[str]]:
    """An HTML block as escaped text: paragraphs (split at blank lines) of escaped lines."""
    paras: list[list[str]] = [[]]
    for line in html.split("\n"):
        line = line.strip()        # all whitespace: a paragraph's ends are trimmed so too
        if line:
            paras[-1].append(_escape(line))
        elif paras[-1]:
            paras.append([])
    return [p for p in paras if p]


@functools.lru_cache(maxsize=1)
def _markdown():
    from markdown_it import MarkdownIt

    # GFM's block grammar as far as markdown-it has it; parse() keeps its state per call.
    return MarkdownIt("commonmark", {"maxNesting": MAX_NESTING}).enable(["table", "strikethrough"])


def render_safe(text: str) -> str:
    """:func:`sanitize_markdown` without its cache (for text seen once, e.g. a stream's tail)."""
    tokens = _markdown().parse(text)
    w = _Writer()
    i, n = 0, len(tokens)
    while i < n:
        t = tokens[i]
        kind = t.type
        if kind == "paragraph_open":
            inline = tokens[i + 1]
            box = w.stack[-1]
            w.begin("paragraph")
            task = box.kind == "item" and not box.started
            body = _inline(inline.children or [], task=task)
            w.write([line.lstrip(" \t") for line in body.split("\n")])
            i += 3
            continue
        if kind == "heading_open":
            inline = tokens[i + 1]
            w.begin("heading")
            body = _inline(inline.children or [], nl=" ")
            w.write([("#" * int(t.tag[1:]) + " " + body).rstrip()])
            i += 3
            continue
        if kind in ("fence", "code_block"):
            w.begin("code")
            w.write(_fence(t.content, t.info if kind == "fence" else ""))
        elif kind == "html_block":
            for para in _html_lines(t.content):
                w.begin("paragraph")
                w.write([line + "\\" for line in para[:-1]] + para[-1:])
        elif kind == "hr":
            w.begin("hr")
            w.write(["___"])          # not the list markers "-" / "*": "* ***" is a rule
        elif kind == "table_open":
            w.begin("table")
            lines, i = _table(tokens, i)
            w.write(lines)
            continue
        elif kind == "blockquote_open":
            w.begin("quote")
            w.stack.append(_Box("quote"))
        elif kind in ("bullet_list_open", "ordered_list_open"):
            box = w.stack[-1]
            marker = t.markup or "-"
            if box.last == "list" and box.last_list == marker:   # a new list right after
                marker = _OTHER_MARKER[marker]                     # one of the same marker
            w.begin("list")
            box.last_list = marker
            start = t.attrGet("start")
            w.stack.append(_Box("list", tight=_tight(tokens, i), marker=marker,
                                number=int(start) if start is not None else 1))
        elif kind == "list_item_open":
            lst = w.stack[-1]
            w.begin("item")
            if lst.marker in (".", ")"):
                marker = f"{lst.number}{lst.marker} "
                lst.number += 1
            else:
                marker = lst.marker + " "
            w.stack.append(_Box("item", tight=lst.tight, marker=marker))
        elif kind in ("blockquote_close", "bullet_list_close", "ordered_list_close",
                      "list_item_close"):
            box = w.stack[-1]
            if not box.last and box.kind in ("item", "quote"):   # empty: its marker alone
                w.write([""])
                w.lines[-1] = w.lines[-1].rstrip()
            w.stack.pop()
        i += 1
    return "\n".join(w.lines)


@functools.lru_cache(maxsize=2048)   # history is re-rendered on every Streamlit rerun
def sanitize_markdown(text: str) -> str:
    """``text`` as Markdown that shows it as written, formatting kept, minus anything a browser
    would fetch or interpret: see the module docstring. Cached (history is re-rendered on every
    rerun)."""
    return render_safe(text)


def _fence_marker(line: str) -> str | None:
    m = _FENCE.match(line)
    return m.group(1) if m else None


def _closes(marker: str, line: str) -> bool:
    m = _fence_marker(line)
    return (m is not None and m[0] == marker[0] and len(m) >= len(marker)
            and line.strip().strip(marker[0]) == "")


def stable_prefix_end(text: str) -> int:
    """Where the Markdown blocks that can no longer change end: the start of the last
    unindented line that follows a blank line outside fenced code (0 if none).

    While streaming, the text before this point can be rendered once and left alone; only the
    rest is re-rendered as tokens arrive, so each update costs about the same however long the
    reply gets.
    """
    end = 0
    offset = 0
    fence: str | None = None
    prev_blank = False
    for line in text.splitlines(keepends=True):
        if fence is None and prev_blank and line[:1] not in (" ", "\t", "\n", "\r", ""):
            end = offset
        if fence is None:
            fence = _fence_marker(line)
        elif _closes(fence, line):
            fence = None
        prev_blank = line.strip() == "" and line.endswith(("\n", "\r"))
        offset += len(line)
    return end


DEMO_MODEL_NOTE = ("This is the tiny random demo model: its replies are gibberish by design. "
                   "Start the app with `--model DIR` (a Qwen3 folder) for real answers.")


def fork_note(query_key: str, original: str) -> str:
    """The line a tab shows when its save found the chat changed by another tab."""
    return (f"This chat was changed in another tab, so this tab's turns continue here as a new "
            f"chat. [The original]({_page_link(query_key, original)}) keeps the other tab's.")


def forks_note(query_key: str, forks: list[str]) -> str:
    """The line under a chat that other tabs continued as new chats."""
    links = ", ".join(f"[{i}]({_page_link(query_key, sid)})" for i, sid in enumerate(forks, 1))
    what = "a new chat" if len(forks) == 1 else "new chats"
    return f"Another tab continued this chat as {what}: {links}."


def _page_link(query_key: str, sid: str) -> str:
    return f"?{query_key}={sid}"       # ids are URL-safe base64 (store.new_session_id)


def format_ms(ms: float) -> str:
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"


def reply_footer(reply: Reply, waited_s: float = 0.0, ended_by: str = "interrupted") -> str:
    """The line under a reply: time to first token, tokens, tokens/s, and how it ended
    (a cancelled reply says ``ended_by``: "stopped" by the Stop button, or "interrupted")."""
    m = reply.metrics
    if m.tokens == 0:
        parts = [f"{ended_by} before the first token" if m.finish_reason == "cancelled"
                 else "no tokens"]
    else:
        parts = [f"first token {format_ms(m.ttft_ms)}", f"{m.tokens} tokens",
                 f"{m.decode_tok_s:.1f} tokens/s"]
        if m.finish_reason == "length":
            parts.append("stopped at max length")
        elif m.finish_reason == "cancelled":
            parts.append(ended_by)
    if waited_s >= 0.1:
        parts.append(f"waited {waited_s:.1f} s for the engine")
    return " · ".join(parts)


def dropped_note(dropped_turns: int) -> str:
    """The note shown when the oldest turns did not fit the context limit ("" if none)."""
    if dropped_turns <= 0:
        return ""
    turns = "turn was" if dropped_turns == 1 else "turns were"
    return (f"The {dropped_turns} oldest {turns} left out of the prompt to fit the context "
            f"limit; the model did not see {'it' if dropped_turns == 1 else 'them'}.")


def waiting_label(position: int, waited_s: float) -> str:
    """Status while a request waits for the shared engine ("" once it runs)."""
    if position <= 0:
        return ""
    ahead = "1 request" if position == 1 else f"{position} requests"
    return f"Waiting for the engine: {ahead} ahead of yours ({waited_s:.0f} s)"


def user_error(err: Exception, doing: str = "answering") -> str:
    """One line for the page: a QwenTrtError's own text (it says what to do); anything else
    is a bug or an environment problem, named briefly (the traceback goes to the server log)."""
    if isinstance(err, QwenTrtError):
        return str(err)
    first = first_line(err)
    detail = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return (f"Unexpected error while {doing} ({detail}). The conversation is kept; try again, "
            f"and see the server log if it keeps happening.")
