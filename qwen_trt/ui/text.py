"""Text the chat UI shows: model output made safe for Markdown, and the lines under replies.

Model output is untrusted. The app renders it with Streamlit's Markdown (GFM), HTML off (tags
show as text). On top of that :func:`sanitize_markdown` makes sure no Markdown image survives
(a browser fetches an image by itself: a prompt-injected reply could leak the chat through its
URL) whatever structure hides it, and that ``<``, ``$`` and Streamlit's ``:red[...]``
directives show as written.
"""
from __future__ import annotations

import functools
import re

from qwen_trt.errors import first_line, QwenTrtError
from qwen_trt.params import Reply

CURSOR = "▌"

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_BACKTICKS = re.compile(r"\\*`+")
# U+2060 WORD JOINER: invisible, and it keeps "!" and "[" apart so no dialect reads an image.
_JOINER = "\u2060"
# An image opener that a renderer could still read as one: "![" after an even run of backslashes.
_LIVE_IMAGE = re.compile(r"(?<!\\)(?:\\\\)*!\[")
# Lines as Markdown counts them (\n, \r\n or \r; not str.splitlines' \x0c, \u2028, ...).
_LINE = re.compile(r"[^\r\n]*(?:\r\n?|\n)|[^\r\n]+")


def _blank(line: str) -> bool:
    return not line.strip(" \t\r\n")


def _fence_marker(line: str) -> str | None:
    m = _FENCE.match(line)
    return m.group(1) if m else None


def _closes(marker: str, line: str) -> bool:
    m = _fence_marker(line)
    return (m is not None and m[0] == marker[0] and len(m) >= len(marker)
            and line.strip().strip(marker[0]) == "")


def _escaper(pattern: str):
    regex = re.compile(r"(\\*)(" + pattern + ")")

    def escape(text: str) -> str:
        def fix(m: re.Match) -> str:
            slashes = m.group(1)
            # An even number of backslashes escapes only themselves: the char is still live.
            return slashes + ("\\" if len(slashes) % 2 == 0 else "") + m.group(2)
        return regex.sub(fix, text)
    return escape


# In prose every one of these gets a backslash, which shows the character as written:
#   "![" an image (an escaped "!" leaves a plain link the user has to click);
#   "<"  raw HTML, an autolink "<http://...>" (Streamlit shows HTML as text anyway);
#   "$"  LaTeX;
#   ":"  before Streamlit's directives, ":red[text]", ":blue-background[x]" (an escaped colon
#        shows the text as written, checked in Chromium on Streamlit 1.67). Icon shortcodes
#        (":material/home:") are matched on the rendered text, so escaping cannot stop them;
#        they are harmless.
_escape_prose = _escaper(r"!(?=\[)|<|\$|:(?=[a-z]+(?:-[a-z]+)*\[)")


def _break_images(text: str) -> str:
    """Code (as we parsed it) keeps its text, but never a "![" a renderer could take for an
    image should it parse the block differently: an invisible joiner goes between the two."""
    return text.replace("![", "!" + _JOINER + "[")


def _outside_code_spans(text: str, fn, in_code=lambda s: s) -> str:
    """Apply ``fn`` to ``text`` outside CommonMark code spans and ``in_code`` to the spans (a
    backtick run closed by the next run of the same length; a backslash-escaped backtick opens
    nothing)."""
    out, pos, i = [], 0, 0
    runs = list(_BACKTICKS.finditer(text))
    while i < len(runs):
        m = runs[i]
        run = m.group(0)
        ticks = run.lstrip("\\")
        if (len(run) - len(ticks)) % 2:        # escaped first backtick: the rest may open
            ticks = ticks[1:]
        start = m.end() - len(ticks)
        close = next((j for j in range(i + 1, len(runs))   # backslashes are literal in code
                      if len(runs[j].group(0).lstrip("\\")) == len(ticks)), None) if ticks else None
        if close is None:
            i += 1
            continue
        out.append(fn(text[pos:start]))
        out.append(in_code(text[start:runs[close].end()]))
        pos = runs[close].end()
        i = close + 1
    out.append(fn(text[pos:]))
    return "".join(out)


@functools.lru_cache(maxsize=1)
def _markdown():
    from markdown_it import MarkdownIt

    # GFM's block grammar as far as markdown-it has it; parse() keeps its state per call.
    return MarkdownIt("commonmark", {"maxNesting": 100}).enable(["table", "strikethrough"])


def _line_kinds(lines: list[str], tokens) -> tuple[list[str], set[int]]:
    """Each line's kind, "prose" unless the parse finds code, and the lines where inline blocks
    start or end (code spans never cross those).

    "keep" is a fence at the top level, unindented, after a blank line (or first): no container
    of any Markdown dialect can hold such a fence, so it is code for every renderer and is left
    exactly as written. Other code ("code": indented, in lists or quotes) is code only as this
    parser sees it: its text stays, but images in it are broken. Lines the parser leaves out
    (reference and footnote definitions, structures deeper than its limit) stay prose.
    """
    kinds = ["prose"] * len(lines)
    edges: set[int] = set()
    for t in tokens:
        if not t.map:
            continue
        a, b = t.map
        if t.type == "inline":
            edges.update((a, b))
        elif t.type in ("fence", "code_block"):
            top = (t.type == "fence" and t.level == 0 and lines[a][:1] in ("`", "~")
                   and (a == 0 or _blank(lines[a - 1])))
            kinds[a:b] = ["keep" if top else "code"] * (b - a)
            edges.update((a, b))
    return kinds, edges


def _segments(lines: list[str], kinds: list[str], edges: set[int]):
    """Runs of lines of one kind; prose also splits at blank lines and block edges."""
    start = 0
    for i in range(1, len(lines) + 1):
        if (i == len(lines) or kinds[i] != kinds[start]
                or (kinds[i] == "prose" and (i in edges or _blank(lines[i - 1])
                                              or _blank(lines[i])))):
            yield kinds[start], "".join(lines[start:i])
            start = i


@functools.lru_cache(maxsize=2048)   # history is re-rendered on every Streamlit rerun
def sanitize_markdown(text: str) -> str:
    """``text`` as Markdown that renders as written, minus anything the browser would fetch.

    Two layers. The parse (markdown-it-py, CommonMark plus GFM tables) only decides where text
    may stay as written: top-level fenced code is kept byte for byte. Everywhere else the
    defence is character level and does not depend on how any dialect builds the tree: in prose
    ``![``, ``<``, ``$`` and ``:red[`` get a backslash (code spans excepted, which show
    backslashes); in other code and in code spans ``![`` gets an invisible joiner. So the only
    ``![`` left in the output either follows an odd run of backslashes (escaped in prose,
    literal in code) or sits in a top-level fence, code in every dialect.
    """
    if "![" not in text and "$" not in text and ":" not in text and "<" not in text:
        return text
    lines = _LINE.findall(text)
    kinds, edges = _line_kinds(lines, _markdown().parse(text))
    out = []
    for kind, seg in _segments(lines, kinds, edges):
        if kind == "prose":
            seg = _outside_code_spans(seg, _escape_prose, _break_images)
        elif kind == "code":
            seg = _break_images(seg)
        if kind != "keep" and _LIVE_IMAGE.search(seg):    # never expected: fail safe
            seg = _break_images(seg)
        out.append(seg)
    return "".join(out)


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
