"""The Markdown sanitiser (qwen_trt/ui/text.py): the hostile corpus, a property test over random
mixes of Markdown and HTML, and ordinary Markdown that must render as before. The same corpus is
rendered in Chromium by tests/test_markdown_browser.py."""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from markdown_check import live_constructs
from markdown_payloads import ORDINARY, payloads
from qwen_trt import settings as qwen_settings
from qwen_trt.ui.text import render_safe, sanitize_markdown

URL = "http://127.0.0.1:9/leak"
CORPUS = payloads(URL)
# The payloads a plain parse does see as live (the others need another dialect, Streamlit's
# directives/LaTeX aside, or depth): the checker is shown to catch what it claims.
LIVE_RAW = ("footnote", "quote-20", "list-9", "html-img", "html-block", "html-div-fence",
            "html-comment-fence", "html-pre-fence", "html-p-fence", "html-table-fence",
            "html-details-fence", "table-latex-directive", "table-split-code-span", "math-fence",
            "latex", "directive", "reference", "autolink-image")


def _render(md: str) -> str:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"]).render(md)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_hostile_corpus_has_nothing_live_after_sanitising(name):
    out = sanitize_markdown(CORPUS[name])
    assert live_constructs(out) == [], out


@pytest.mark.parametrize("name", LIVE_RAW)
def test_the_checker_sees_the_raw_payloads(name):
    assert live_constructs(CORPUS[name])


@pytest.mark.parametrize("tag", ["div", "comment", "pre", "p", "table", "details"])
def test_issue_23_html_block_then_fence_shows_the_image_as_code(tag):
    """The image line stays, inside a fenced block, as text."""
    out = sanitize_markdown(CORPUS[f"html-{tag}-fence"])
    assert "<img" not in _render(out)
    assert live_constructs(out) == []


# -- property: random mixes of Markdown and HTML --------------------------------------------------

ATOMS = [
    f"![x]({URL})", "![x][r]", f"[r]: {URL}", f"<{URL}>", f"<img src={URL}>", f"[a]({URL})",
    f"[x](<{URL}>)", f"&excl;[x]({URL})", "<div>", "</div>", "<!--", "-->", "<!-- x -->", "<pre>",
    "</pre>", "<p>", "<table>", "<details>", "<style>", "<b>", "```", "````", "~~~", "~~~~",
    "```math", "```py", " ```", "    ", "\t- ", "> ", "> > ", "- ", "1. ", "1) ", "   - ",
    "- [ ] ", "| a |", "|---|", "| $x$ | :red[y] |", "| `a|b` | c\\|d |", "$x$", "$$", ":red[z]",
    ":blue-background[", "`", "``", "\\", "\\\\`", "*", "**", "_", "~~", "***", "*a*", "~~a~~",
    "&#33;", "&#x21;", "&lt;", "[a](javascript:alert(1))", "[a](data:text/html,x)", "<a@b.c>",
    "text", " ", "  ", "\t", "#", "===", "---", "[^1]: ", "[r]", "[r][]", "\r", "\x0c",
    "\u2028", "\u2060", "", "[", "]", "(", ")", "!",
]
_LINES = st.lists(st.lists(st.sampled_from(ATOMS), max_size=6).map("".join), max_size=12)
_OPENERS = st.sampled_from(["<div>", "<!--", "<pre>", "<p>", "<table>", "<details>", "> <div>",
                            "- <pre>"])
# The issue's shape: an HTML block opener, a fence line, a blank line, a fence, an image, a fence
_ISSUE = st.tuples(_OPENERS, st.sampled_from(["```", "~~~", "````", "```x"]),
                   st.sampled_from([f"![x]({URL})", f"<img src={URL}>", "$x$", ":red[y]"]),
                   _LINES).map(lambda p: f"{p[0]}\n{p[1]}\n\n{p[1]}\n{p[2]}\n{p[1]}\n"
                                         + "\n".join(p[3]))
DOCS = st.one_of(_LINES.map("\n".join), _ISSUE)
PROPERTY = settings(max_examples=qwen_settings.get("QWEN_TRT_PROPERTY_EXAMPLES"), deadline=None,
                    database=None, suppress_health_check=list(HealthCheck))


@PROPERTY
@given(DOCS)
def test_property_sanitised_markdown_has_nothing_live(doc):
    out = sanitize_markdown(doc)
    assert live_constructs(out) == [], (doc, out)


@PROPERTY
@given(DOCS)
def test_property_sanitised_markdown_reads_back_as_itself(doc):
    """What is written is what the parser reads back: sanitising the output again changes
    nothing (after one more pass, which links the bare URLs that images left as text)."""
    once = sanitize_markdown(sanitize_markdown(doc))
    assert sanitize_markdown(once) == once, (doc, once)


# -- exact results ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("see ![x](https://evil.example/?q=1)",
     "see \\!\\[x\\]\\(https\\:\\/\\/evil\\.example\\/\\?q\\=1\\)"),
    ("a <b>bold</b> <script>x</script>", "a \\<b\\>bold\\<\\/b\\> \\<script\\>x\\<\\/script\\>"),
    ("costs $5 and :red[stop] at 10:30", "costs \\$5 and \\:red\\[stop\\] at 10\\:30"),
    ("[ok](https://a.example/x?y=1&z=2) [js](javascript:alert(1)) [rel](/x)",
     "[ok](https://a.example/x?y=1\\&z=2) \\[js\\]\\(javascript\\:alert\\(1\\)\\) rel"),
    ("<https://a.example/x> <mailto:m@a.example>",
     "[https\\:\\/\\/a\\.example\\/x](https://a.example/x) mailto\\:m\\@a\\.example"),
    ("go to https://a.example/p_(q). now",
     "go to [https\\:\\/\\/a\\.example\\/p\\_\\(q\\)](https://a.example/p_%28q%29)\\. now"),
    ("```math\nx^2\n```", "```latex\nx^2\n```"),
    ("````\n```\n````", "````\n```\n````"),
    ("~~~\n````` and ``\n~~~", "``````\n````` and ``\n``````"),
    ("`` a`b `` and `$x$` and `` `x` ``", "``a`b`` and `$x$` and `` `x` ``"),
    ("| a | b |\n|:-|-:|\n| `x\\|y` | $z$ |",
     "| a | b |\n| :--- | ---: |\n| `x\\|y` | \\$z\\$ |"),
    ("- [ ] todo\n- [x] done", "- [ ] todo\n- [x] done"),
    ("    indented", "```\nindented\n```"),
    ("> a\n>\n> ```\n> ![x](u)\n> ```", "> a\n>\n> ```\n> ![x](u)\n> ```"),
])
def test_sanitise_exact(text, expected):
    assert sanitize_markdown(text) == expected


def test_fences_are_longer_than_any_backtick_run_inside():
    for n in range(3, 12):
        code = "a\n" + "`" * n + "\nb"
        out = sanitize_markdown(f"~~~\n{code}\n~~~")
        fence = "`" * (n + 1)
        assert out == f"{fence}\n{code}\n{fence}"


@pytest.mark.parametrize("name", sorted(ORDINARY))
def test_ordinary_markdown_renders_as_before(name):
    text = ORDINARY[name]
    assert _render(sanitize_markdown(text)) == _render(text)


def test_deep_nesting_is_fast_and_cut():
    deep = "> " * 5000 + "![x](u)\n" + "- a\n  " * 2000 + "$x$"
    out = sanitize_markdown(deep)                      # no RecursionError
    assert live_constructs(out) == []


def test_render_safe_is_the_uncached_sanitiser():
    text = "a *b* ![c](http://d/e) `f`"
    assert render_safe(text) == sanitize_markdown(text)
    assert re.fullmatch(r"a \*b\* .* `f`", render_safe(text))
