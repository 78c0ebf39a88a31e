"""The HTML the app shows for untrusted text (qwen_trt/ui/text.py): the hostile corpus, property
tests over random mixes of Markdown and HTML (nothing outside the allow-list; the same document
markdown-it reads, minus only what the policy takes out), and ordinary Markdown that stays
readable. The same corpus is rendered in Chromium by tests/test_markdown_browser.py."""
from __future__ import annotations

import html

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from markdown_check import TAGS, naive_html, reference_html, shape, violations
from markdown_payloads import ORDINARY, payloads
from qwen_trt import settings as qwen_settings
from qwen_trt.ui.text import ALLOWED_TAGS, CSS_CLASS, markdown_html, render_html

URL = "http://127.0.0.1:9/leak"
CORPUS = payloads(URL)
# Payloads a renderer with raw HTML on does make live (images, raw HTML, non-http links): the
# checker is shown to catch what it claims. (LaTeX, directives and shortcodes are Streamlit's
# dialect: the browser test's raw controls show those.)
LIVE_RAW = ("quote-20", "list-9", "html-img", "html-block", "html-details", "html-style",
            "reference", "autolink-image", "mailto-autolink", "email-autolink", "lazy-comment",
            "lazy-script", "image-title", "table")


def test_the_app_allows_no_more_than_the_checker():
    assert ALLOWED_TAGS <= TAGS and "img" not in ALLOWED_TAGS and CSS_CLASS == "qwen-trt-md"


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_hostile_corpus_is_inside_the_allow_list(name):
    out = markdown_html(CORPUS[name])
    assert violations(out) == [], out


@pytest.mark.parametrize("name", LIVE_RAW)
def test_the_checker_sees_the_raw_payloads(name):
    assert violations(naive_html(CORPUS[name]))


@pytest.mark.parametrize("name", [n for n in sorted(CORPUS) if n.startswith("lazy-") and
                                  "latex" not in n] + ["html-div-fence", "html-comment-fence",
                                                       "list-9", "quote-20"])
def test_issue_35_and_23_images_show_as_their_source_text(name):
    """The lazy-paragraph and HTML-then-fence families: whichever way the one parser reads the
    text, the image is shown as written (code or text), never as an image."""
    out = markdown_html(CORPUS[name])
    assert "<img" not in out and f"]({URL})" in shape(out)[1], out


def test_issue_35_mail_shortcodes_latex_and_directives_are_text():
    for name, shown in (("email", "someone@example.com"),
                        ("email-autolink", "someone@example.com"),
                        ("mailto-autolink", "mailto:someone@example.com"),
                        ("shortcode", ":streamlit: and :smile: :material/home:"),
                        ("directive", ":red[stop] :blue-background[bg]"),
                        ("latex-emphasis", "$x^2$")):
        out = markdown_html(CORPUS[name])
        assert shown in html.unescape(out) and "<a" not in out, (name, out)


# -- properties: random mixes of Markdown and HTML -----------------------------------------------

ATOMS = [
    f"![x]({URL})", "![x][r]", f"[r]: {URL}", f"<{URL}>", f"<img src={URL}>", f"[a]({URL})",
    f"[x](<{URL}>)", f"&excl;[x]({URL})", "<div>", "</div>", "<!--", "-->", "<!-- x -->", "<pre>",
    "</pre>", "<p>", "<table>", "<details>", "<style>", "<b>", "<?x?>", "<!X>", "<![CDATA[x]]>",
    "```", "````", "~~~", "~~~~", "```math", "```py", " ```", "    ", "\t- ", "> ", "> > ", "- ",
    "1. ", "2. ", "5) ", "1) ", "   - ", "  ", "- [ ] ", "| a |", "|---|", "| $x$ | :red[y] |",
    "| `a|b` | c\\|d |", "$x$", "$$", ":red[z]", ":streamlit:", ":blue-background[", "`", "``",
    "\\", "\\\\`", "*", "**", "_", "~~", "***", "*a*", "~~a~~", "&#33;", "&#x21;", "&lt;",
    "&quot;", "[a](javascript:alert(1))", "[a](data:text/html,x)", "<a@b.c>", "<mailto:m@a.b>",
    "a@b.example", "http://a.example/x_(y)", "https://", "[](http://e.example)", "text", " ",
    "\t", "#", "===", "---", "[^1]: ", "[r]", "[r][]", "\r", "\x0c", "\u2028", "\u2060", "", "[",
    "]", "(", ")", "!", "\"", "'", "<", ">", "&",
]
_LINES = st.lists(st.lists(st.sampled_from(ATOMS), max_size=6).map("".join), max_size=12)
_OPENERS = st.sampled_from(["<div>", "<!--", "<pre>", "<p>", "<table>", "<details>", "> <div>",
                            "- <pre>"])
# issue 23's shape: an HTML block opener, a fence line, a blank line, a fence, an image, a fence
_ISSUE_23 = st.tuples(_OPENERS, st.sampled_from(["```", "~~~", "````", "```x"]),
                      st.sampled_from([f"![x]({URL})", f"<img src={URL}>", "$x$", ":red[y]"]),
                      _LINES).map(lambda p: f"{p[0]}\n{p[1]}\n\n{p[1]}\n{p[2]}\n{p[1]}\n"
                                            + "\n".join(p[3]))
# issue 35's shape: a list item holding an HTML block that ends on its line, then an ordered
# list not starting at 1 whose item opens a fence
_ISSUE_35 = st.tuples(st.sampled_from(["- ", "* ", "> - ", "- a\n  - "]),
                      st.sampled_from(["<!-- c -->", "<pre>x</pre>", "<?x?>", "<!X>",
                                       "<script>x</script>"]),
                      st.sampled_from(["2. ", "7) ", "10. "]),
                      st.sampled_from([f"![x]({URL})", "$x$ :red[y]", "a@b.example"]),
                      _LINES).map(lambda p: f"{p[0]}{p[1]}\n  {p[2]}```\n     {p[3]}\n     ```\n"
                                            + "\n".join(p[4]))
DOCS = st.one_of(_LINES.map("\n".join), _ISSUE_23, _ISSUE_35)
PROPERTY = settings(max_examples=qwen_settings.get("QWEN_TRT_PROPERTY_EXAMPLES"), deadline=None,
                    database=None, suppress_health_check=list(HealthCheck))


@PROPERTY
@given(DOCS)
def test_property_the_html_is_inside_the_allow_list(doc):
    """Differential: whatever the Markdown, the HTML handed to the browser, read back by an
    independent HTML parser, has no element or attribute outside the allow-list."""
    out = render_html(doc)
    assert violations(out) == [], (doc, out)


@PROPERTY
@given(DOCS)
def test_property_one_parser_decides(doc):
    """Differential: our HTML is markdown-it's own reading of the text (its reference renderer,
    raw HTML off): the same elements in the same order and the same text, save only what the
    policy changes (images shown as their source text, links kept for http(s) only)."""
    mine = shape(render_html(doc))
    ref = shape(reference_html(doc), images_as_source=True)
    assert mine == ref, (doc, mine, ref)


# -- exact results ----------------------------------------------------------------------------

A = 'target="_blank" rel="noopener noreferrer nofollow"'


def _body(out: str) -> str:
    assert out.startswith(f'<div class="{CSS_CLASS}">') and out.endswith("</div>")
    return out[len(f'<div class="{CSS_CLASS}">'):-len("</div>")].strip()


@pytest.mark.parametrize("text, expected", [
    ("see ![x](https://evil.example/?q=1)", "<p>see ![x](https://evil.example/?q=1)</p>"),
    ("a <b>bold</b> <script>x</script>",
     "<p>a &lt;b&gt;bold&lt;/b&gt; &lt;script&gt;x&lt;/script&gt;</p>"),
    ("costs $5 and :red[stop] at 10:30 :streamlit:",
     "<p>costs $5 and :red[stop] at 10:30 :streamlit:</p>"),
    ("[ok](https://a.example/x?y=1&z=2) [js](javascript:alert(1)) [rel](/x) [m](mailto:a@b.c)",
     f'<p><a href="https://a.example/x?y=1&amp;z=2" {A}>ok</a> [js](javascript:alert(1)) rel '
     "m</p>"),
    ("<https://a.example/x> <mailto:m@a.example> <m@a.example> m@a.example",
     f'<p><a href="https://a.example/x" {A}>https://a.example/x</a> mailto:m@a.example '
     "m@a.example m@a.example</p>"),
    ("go to https://a.example/p_(q). now",
     f'<p>go to <a href="https://a.example/p_(q)" {A}>https://a.example/p_(q)</a>. now</p>'),
    ("[![i](http://i.example/p)](http://l.example)",
     f'<p><a href="http://l.example" {A}>![i](http://i.example/p)</a></p>'),
    ("```math\nx^2\n```", "<pre><code>x^2\n</code></pre>"),
    ("```py\nif a < b:\n    pass\n```", "<pre><code>if a &lt; b:\n    pass\n</code></pre>"),
    ("`` a`b `` and `$x$`", "<p><code>a`b</code> and <code>$x$</code></p>"),
    ("| a | b |\n|:-|-:|\n| `x\\|y` | $z$ |",
     '<table>\n<thead>\n<tr>\n<th align="left">a</th>\n<th align="right">b</th>\n</tr>\n'
     '</thead>\n<tbody>\n<tr>\n<td align="left"><code>x|y</code></td>\n'
     '<td align="right">$z$</td>\n</tr>\n</tbody>\n</table>'),
    ("3. a\n4. b", '<ol start="3">\n<li>a</li>\n<li>b</li>\n</ol>'),
    # raw HTML is text (markdown-it, html off): "2." cannot interrupt that paragraph either,
    # but the image line is drawn as its source text, and only once
    ("- <!-- c -->\n  2. ```\n     ![x](u)\n     ```",
     "<ul>\n<li>&lt;!-- c --&gt;\n2. ```\n![x](u)<pre><code></code></pre>\n</li>\n</ul>"),
    ("~~gone~~ **b** _i_", "<p><s>gone</s> <strong>b</strong> <em>i</em></p>"),
])
def test_exact_html(text, expected):
    assert _body(markdown_html(text)) == expected


@pytest.mark.parametrize("name", sorted(ORDINARY))
def test_ordinary_markdown_reads_as_markdown_it_renders_it(name):
    text = ORDINARY[name]
    assert shape(markdown_html(text)) == shape(reference_html(text)), name


def test_deep_nesting_is_fast_and_cut():
    deep = "> " * 5000 + "![x](u)\n" + "- a\n  " * 2000 + "$x$"
    out = markdown_html(deep)                          # no RecursionError
    assert violations(out) == [] and out.count("<blockquote>") <= 100


def test_render_html_is_the_uncached_markdown_html():
    text = "a *b* ![c](http://d/e) `f`"
    assert render_html(text) == markdown_html(text)
    assert render_html("") == f'<div class="{CSS_CLASS}"></div>'     # never an empty body


def test_a_link_with_a_quote_keeps_it_percent_encoded():
    """hypothesis found it: a bare URL with ``'`` in it was linked with the quote raw in its
    href (harmless inside double quotes, but outside the contract: no quote in an href)."""
    out = render_html("http://a.example/x_(y)'![x][r]")
    assert violations(out) == [] and "%27" in out
