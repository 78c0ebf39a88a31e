"""Text the chat UI shows: model output made safe for Markdown, and the lines under replies.

Model output is untrusted. The app renders it with Streamlit's Markdown, HTML off (tags show as
text). On top of that :func:`sanitize_markdown` neutralises Markdown images, which a browser
would fetch by itself (a prompt-injected reply could leak data through an image URL): ``![a](u)``
becomes the escaped ``\\![a](u)``, a plain link the user has to click. Code spans and fenced code
are left as they are (escapes are not processed there, so they need none).
"""
from __future__ import annotations

import functools
import re

from qwen_trt.errors import QwenTrtError
from qwen_trt.params import Reply

CURSOR = "▌"

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_IMAGE = re.compile(r"(\\*)!\[")
_DOLLAR = re.compile(r"(\\*)\$")
_BACKTICKS = re.compile(r"\\*`+")


def _fence_marker(line: str) -> str | None:
    m = _FENCE.match(line)
    return m.group(1) if m else None


def _closes(marker: str, line: str) -> bool:
    m = _fence_marker(line)
    return (m is not None and m[0] == marker[0] and len(m) >= len(marker)
            and line.strip().strip(marker[0]) == "")


def _escaper(pattern: re.Pattern, literal: str):
    def escape(text: str) -> str:
        def fix(m: re.Match) -> str:
            slashes = m.group(1)
            # An even number of backslashes escapes only themselves: the char is still live.
            return slashes + ("\\" if len(slashes) % 2 == 0 else "") + literal
        return pattern.sub(fix, text)
    return escape


_escape_images = _escaper(_IMAGE, "![")
_escape_dollars = _escaper(_DOLLAR, "$")
# Streamlit's own Markdown directives, ":red[text]", ":blue-background[x]": an escaped colon
# shows the text as written (checked in Chromium on Streamlit 1.67). Icon shortcodes
# (":material/home:") are matched on the rendered text, so escaping cannot stop them; they are
# harmless.
_DIRECTIVE = re.compile(r"(\\*):(?=[a-z]+(?:-[a-z]+)*\[)")
_escape_directives = _escaper(_DIRECTIVE, ":")


def _escape_prose(text: str) -> str:
    return _escape_directives(_escape_dollars(text))


def _outside_code_spans(text: str, fn) -> str:
    """Apply ``fn`` to ``text`` except inside CommonMark code spans (a backtick run closed by
    the next run of the same length; a backslash-escaped backtick opens nothing)."""
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
        out.append(text[start:runs[close].end()])
        pos = runs[close].end()
        i = close + 1
    out.append(fn(text[pos:]))
    return "".join(out)


@functools.lru_cache(maxsize=1)
def _markdown():
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark")   # parse() keeps its state per call: safe to share


def _parse(text: str):
    return _markdown().parse(text)


def _has_image(tokens) -> bool:
    return any(t.type == "image" or (t.children and _has_image(t.children)) for t in tokens)


def _prose_blocks(tokens) -> list[tuple[int, int, bool, bool]]:
    """(first line, end line, escape images?, is prose?) of each paragraph/heading block, and of
    each raw HTML block (Streamlit shows those as text; image syntax in them is escaped all the
    same, in case a renderer ever parses it)."""
    return [(t.map[0], t.map[1], _has_image(t.children or []) or t.type == "html_block",
             t.type == "inline") for t in tokens if t.type in ("inline", "html_block") and t.map]


@functools.lru_cache(maxsize=2048)   # history is re-rendered on every Streamlit rerun
def sanitize_markdown(text: str) -> str:
    """``text`` as Markdown that renders exactly as written, minus anything the browser fetches.

    Parsed as CommonMark (markdown-it-py, the grammar Streamlit's renderer follows); code blocks
    are left alone. In prose, every image becomes an inert escaped ``\\![a](u)`` (a link the
    user must click: a prompt-injected image URL could leak data), and ``$`` and Streamlit's
    ``:color[...]`` directives outside code spans are escaped, so a reply that says
    "$x$" or ":red[x]" shows exactly that rather than LaTeX or coloured text.
    """
    if "![" not in text and "$" not in text and ":" not in text:
        return text
    lines = text.splitlines(keepends=True)
    for start, end, has_image, prose in _prose_blocks(_parse(text)):
        block = "".join(lines[start:end])
        if has_image:
            block = _escape_images(block)
        if prose:
            block = _outside_code_spans(block, _escape_prose)
        lines[start:end] = [block] + [""] * (end - start - 1)
    out = "".join(lines)
    if _has_image(_parse(out)):                     # never expected: fail safe, as code
        fence = "`" * max(3, max((len(r) for r in re.findall(r"`+", out)), default=0) + 1)
        out = f"{fence}text\n{out}\n{fence}\n"
    return out


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


def reply_footer(reply: Reply, waited_s: float = 0.0) -> str:
    """The line under a reply: time to first token, tokens, tokens/s, and how it ended."""
    m = reply.metrics
    if m.tokens == 0:
        parts = ["interrupted before the first token" if m.finish_reason == "cancelled"
                 else "no tokens"]
    else:
        parts = [f"first token {format_ms(m.ttft_ms)}", f"{m.tokens} tokens",
                 f"{m.decode_tok_s:.1f} tokens/s"]
        if m.finish_reason == "length":
            parts.append("stopped at max length")
        elif m.finish_reason == "cancelled":
            parts.append("interrupted")
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
    first = (str(err).strip().splitlines() or [""])[0][:300]
    detail = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return (f"Unexpected error while {doing} ({detail}). The conversation is kept; try again, "
            f"and see the server log if it keeps happening.")
