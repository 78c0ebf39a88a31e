"""What a renderer would make of Markdown: anything live a sanitised text must not contain.

``live_constructs(md)`` parses ``md`` with markdown-it (CommonMark with HTML on, GFM tables and
strikethrough, deep nesting allowed) plus two inline rules that stand for what Streamlit adds:
an unescaped ``$`` (remark-math's inline and display math) and an unescaped ``:name[``
(Streamlit's directives such as ``:red[...]``). Both rules run where the parser looks for inline
syntax, so a backslash-escaped character or the inside of a code span never triggers them,
while a table cell does. It returns every image, raw HTML block or span, math, directive, math
fence and link whose scheme is not http(s).
"""
from __future__ import annotations

import functools
import re

_DIRECTIVE = re.compile(r":[A-Za-z][\w-]*\[")


def _live_sign(state, silent: bool) -> bool:
    ch = state.src[state.pos]
    if ch == "$":
        kind = "math"
    elif ch == ":" and _DIRECTIVE.match(state.src, state.pos):
        kind = "directive"
    else:
        return False
    if not silent:
        state.push(kind, "", 0).content = state.src[state.pos:state.pos + 20]
    state.pos += 1
    return True


@functools.lru_cache(maxsize=1)
def _checker():
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": True, "maxNesting": 10_000})
    md.enable(["table", "strikethrough"])
    md.inline.ruler.before("text", "live_sign", _live_sign)
    return md


def live_constructs(md: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    todo = list(_checker().parse(md))
    while todo:
        t = todo.pop()
        if t.type in ("image", "html_block", "html_inline", "math", "directive"):
            found.append((t.type, t.content[:60]))
        elif t.type == "fence" and t.info.strip().lower().startswith("math"):
            found.append(("math fence", t.info))
        elif t.type == "link_open":
            href = t.attrGet("href") or ""
            if not re.match(r"https?://", href, re.IGNORECASE):
                found.append(("link", href))
        todo.extend(t.children or [])
    return found
