"""Text the chat UI shows: model output rendered to safe HTML, and the lines under replies.

Model output and user text are untrusted. :func:`markdown_html` gives the HTML the browser gets,
decided by ONE parser: markdown-it-py parses the text (CommonMark plus GFM tables and
strikethrough, raw HTML off, so ``<b>`` is text), our renderer writes HTML from the parse tree,
and nh3 (ammonia, an allow-list HTML sanitiser) keeps only :data:`ALLOWED_TAGS` and
:data:`ALLOWED_ATTRIBUTES`. The app shows it with ``st.html``, which parses no Markdown: no
second parser can read the text again (no LaTeX, directives, shortcodes, e-mail autolinks).
Images show as their source text (nothing is fetched); links are kept only for ``http(s)``
(a click is needed; others show their text); code keeps its text in ``<pre><code>``.
"""
from __future__ import annotations

import functools
import re

from qwen_trt.errors import first_line, QwenTrtError
from qwen_trt.params import Reply

CURSOR = "▌"

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HTTP = re.compile(r"https?://[^\s]", re.IGNORECASE)
# A bare URL in text (GFM autolinks these); trailing punctuation is not part of it.
_BARE_URL = re.compile(r"(?<![A-Za-z0-9])https?://[^\s<>]+", re.IGNORECASE)
_URL_TRAIL = "?!.,:*_~'\";"
# Deeper structures are cut by the parser (their text is left out of the output).
MAX_NESTING = 100

# What the browser may get. Nothing here loads anything: no img/picture/source/video/audio,
# no iframe/object/embed, no style/script/link/meta, no form controls; no style, class, id,
# src or event attributes. <a> keeps http(s) hrefs only, and opens in a new tab.
ALLOWED_TAGS = frozenset({
    "div", "p", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "ul", "ol", "li", "hr", "br",
    "pre", "code", "em", "strong", "s", "a", "table", "thead", "tbody", "tr", "th", "td"})
ALIGN = frozenset({"left", "right", "center"})
ALLOWED_ATTRIBUTES: dict[str, frozenset[str]] = {
    "a": frozenset({"href", "target", "rel"}), "ol": frozenset({"start"}),
    "th": frozenset({"align"}), "td": frozenset({"align"})}
URL_SCHEMES = frozenset({"http", "https"})
LINK_REL = "noopener noreferrer nofollow"


# The wrapper every rendered text gets (ours, added after the sanitiser), and the page's style
# for it (constant; the app draws it once per run with st.html, which puts a <style>-only body
# out of the page flow). Readable code blocks, tables and quotes in light and dark themes.
CSS_CLASS = "qwen-trt-md"
PAGE_CSS = """<style>
.qwen-trt-md > :last-child, .qwen-trt-md li > :last-child { margin-bottom: 0; }
.qwen-trt-md code { font-size: 0.875em; padding: 0.1em 0.25em; border-radius: 0.25rem;
  background: rgba(128, 128, 128, 0.12); overflow-wrap: break-word; }
.qwen-trt-md pre { padding: 0.75rem 1rem; border-radius: 0.5rem; overflow-x: auto;
  background: rgba(128, 128, 128, 0.12); margin: 0 0 1rem 0; line-height: 1.4; }
.qwen-trt-md pre code { padding: 0; background: none; font-size: 0.85em; white-space: pre;
  overflow-wrap: normal; }
.qwen-trt-md blockquote { margin: 0 0 1rem 0; padding-left: 1rem;
  border-left: 0.2rem solid rgba(128, 128, 128, 0.4); }
.qwen-trt-md table { border-collapse: collapse; margin-bottom: 1rem; }
.qwen-trt-md th, .qwen-trt-md td { border: 1px solid rgba(128, 128, 128, 0.3);
  padding: 0.25rem 0.75rem; }
</style>"""


@functools.lru_cache(maxsize=1)
def _cleaner():
    import nh3

    return nh3.Cleaner(
        tags=set(ALLOWED_TAGS), clean_content_tags={"script", "style"},
        attributes={"a": {"href"}, "ol": {"start"}},
        tag_attribute_values={"th": {"align": set(ALIGN)}, "td": {"align": set(ALIGN)}},
        set_tag_attribute_values={"a": {"target": "_blank"}},
        url_schemes=set(URL_SCHEMES), url_relative="deny", link_rel=LINK_REL,
        strip_comments=True)


def _bare_url_end(url: str) -> int:
    end = len(url)
    while end and (url[end - 1] in _URL_TRAIL
                   or (url[end - 1] == ")" and url.count("(", 0, end) < url.count(")", 0, end))):
        end -= 1
    return end


@functools.lru_cache(maxsize=1)
def _renderer_cls():
    from markdown_it.common.utils import escapeHtml
    from markdown_it.renderer import RendererHTML

    def a_open(href: str) -> str:
        # markdown-it's normalizeLink leaves quotes and backticks: percent-encoded here, so an
        # href never holds a character that could close an attribute, quoted either way
        href = href.replace("'", "%27").replace("`", "%60")
        return f'<a href="{escapeHtml(href)}">'

    class SafeRenderer(RendererHTML):
        """markdown-it's HTML renderer minus everything that fetches or is not ours to show.

        ``env["links"]`` is the stack of open links: True for one written as ``<a>``, False
        for one shown as its text."""

        def __init__(self, parser=None):
            super().__init__(parser)
            self._md = parser

        def link_open(self, tokens, idx, options, env):
            href = tokens[idx].attrGet("href") or ""
            stack = env.setdefault("links", [])
            live = bool(_HTTP.match(href)) and not any(stack)
            stack.append(live)
            if not live:
                return ""
            if idx + 1 < len(tokens) and tokens[idx + 1].type == "link_close":
                return a_open(href) + escapeHtml(href)      # no text: show the address
            return a_open(href)

        def link_close(self, tokens, idx, options, env):
            stack = env.setdefault("links", [])
            return "</a>" if stack and stack.pop() else ""

        def image(self, tokens, idx, options, env):
            t = tokens[idx]
            alt = self.renderInlineAsText(t.children, options, env).replace("\n", " ")
            return escapeHtml(f"![{alt}]({t.attrGet('src') or ''})")

        def text(self, tokens, idx, options, env):
            text = tokens[idx].content
            if any(env.get("links", ())) or "://" not in text:
                return escapeHtml(text)
            out, pos = [], 0                 # bare http(s) URLs become links (GFM's autolinks)
            for m in _BARE_URL.finditer(text):
                url = m.group()[:_bare_url_end(m.group())]
                href = self._md.normalizeLink(url)       # percent-encoded, as a link's is
                if len(url) <= len("https://") or not self._md.validateLink(href):
                    continue
                out += [escapeHtml(text[pos:m.start()]), a_open(href), escapeHtml(url), "</a>"]
                pos = m.start() + len(url)
            out.append(escapeHtml(text[pos:]))
            return "".join(out)

        def fence(self, tokens, idx, options, env):
            return f"<pre><code>{escapeHtml(tokens[idx].content)}</code></pre>\n"

        code_block = fence

        def html_block(self, tokens, idx, options, env):    # not parsed (html off): as text
            return f"<p>{escapeHtml(tokens[idx].content)}</p>\n"

        def html_inline(self, tokens, idx, options, env):
            return escapeHtml(tokens[idx].content)

        def _cell(self, tokens, idx, options, env):
            t = tokens[idx]
            style = (t.attrGet("style") or "").removeprefix("text-align:")
            return f'<{t.tag} align="{style}">' if style in ALIGN else f"<{t.tag}>"

        th_open = td_open = _cell

    return SafeRenderer


@functools.lru_cache(maxsize=1)
def _markdown():
    from markdown_it import MarkdownIt

    # GFM's block grammar as far as markdown-it has it, raw HTML off; parse() keeps its state
    # per call.
    return MarkdownIt("commonmark", {"maxNesting": MAX_NESTING, "html": False},
                      renderer_cls=_renderer_cls()).enable(["table", "strikethrough"])


def render_html(text: str) -> str:
    """:func:`markdown_html` without its cache (for text seen once, e.g. a stream's tail)."""
    body = _cleaner().clean(_markdown().render(text))
    return f'<div class="{CSS_CLASS}">{body}</div>'   # never empty: st.html refuses that


@functools.lru_cache(maxsize=2048)   # history is re-rendered on every Streamlit rerun
def markdown_html(text: str) -> str:
    """``text`` (Markdown) as the HTML the page shows: formatting kept, nothing outside the
    allow-list (see the module docstring). Cached (history is re-rendered on every rerun)."""
    return render_html(text)


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
        per_step = m.tokens_per_step
        if per_step is not None and per_step > 1.0:     # speculative decoding accepted drafts
            parts.append(f"{per_step:.2f} tokens/step")
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
