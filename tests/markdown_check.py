"""What the browser would get from a text: checks on the HTML the app hands to ``st.html``.

``violations(html)`` parses ``html`` with the standard library's ``html.parser`` and returns
every element, attribute, comment, declaration or processing instruction outside the allow-list
below, and any link that is not http(s). The allow-list is written here, on its own, so that
widening the app's list (``qwen_trt.ui.text.ALLOWED_TAGS``) fails the tests instead of passing
them.

``naive_html(md)`` is the control: what a Markdown renderer with raw HTML on makes of ``md``
(markdown-it's own renderer), so the checker is shown to catch what it claims.

``shape(html)`` is a document's elements in order (tag names, with links and images taken out)
and its visible text, for comparing our HTML with markdown-it's reference rendering.
"""
from __future__ import annotations

import functools
import html.parser
import re

TAGS = {"div", "p", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "ul", "ol", "li", "hr",
        "br", "pre", "code", "em", "strong", "s", "a", "table", "thead", "tbody", "tr", "th",
        "td"}
WRAPPER_CLASS = "qwen-trt-md"
_HTTP = re.compile(r"https?://[^\s\"'<>`]+\Z", re.IGNORECASE)


def _attr_ok(tag: str, name: str, value: str | None, first: bool) -> bool:
    value = value or ""
    if tag == "div" and name == "class":
        return first and value == WRAPPER_CLASS      # the wrapper only, the outermost element
    if tag == "a":
        return ((name == "href" and bool(_HTTP.match(value)))
                or (name == "target" and value == "_blank")
                or (name == "rel" and value == "noopener noreferrer nofollow"))
    if tag == "ol" and name == "start":
        return value.isdigit()
    return tag in ("th", "td") and name == "align" and value in ("left", "right", "center")


class _Checker(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[tuple[str, str]] = []
        self.first = True

    def handle_starttag(self, tag, attrs):
        if tag not in TAGS:
            self.found.append(("element", tag))
        for name, value in attrs:
            if not _attr_ok(tag, name, value, self.first):
                self.found.append(("attribute", f"{tag} {name}={value!r}"))
        self.first = False

    handle_startendtag = handle_starttag

    def handle_comment(self, data):
        self.found.append(("comment", data[:60]))

    def handle_decl(self, decl):
        self.found.append(("declaration", decl[:60]))

    def unknown_decl(self, data):
        self.found.append(("declaration", data[:60]))

    def handle_pi(self, data):
        self.found.append(("processing instruction", data[:60]))


def violations(html_text: str) -> list[tuple[str, str]]:
    p = _Checker()
    p.feed(html_text)
    p.close()
    return p.found


@functools.lru_cache(maxsize=2)
def _reference(raw_html: bool):
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": raw_html, "maxNesting": 100})
    return md.enable(["table", "strikethrough"])


def naive_html(md: str) -> str:
    """``md`` through a renderer with raw HTML on (the control)."""
    return _reference(True).render(md)


def reference_html(md: str) -> str:
    """``md`` through markdown-it's own renderer, raw HTML off (the app's parser, its
    reference output)."""
    return _reference(False).render(md)


class _Shape(html.parser.HTMLParser):
    def __init__(self, images_as_source: bool) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.text: list[str] = []
        self.images_as_source = images_as_source
        self.links: list[tuple[str, int]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a" and self.images_as_source:
            self.links.append((dict(attrs).get("href") or "", len(self.text)))
        if tag == "img":
            if self.images_as_source:      # what the app shows instead of an image
                a = dict(attrs)
                alt = (a.get("alt") or "").replace("\n", " ")
                self.text.append(f"![{alt}]({a.get('src') or ''})")
        elif tag not in ("a", "div"):
            self.tags.append(tag)

    handle_startendtag = handle_starttag

    def handle_endtag(self, tag):
        if tag == "a" and self.links:            # the app shows an empty http(s) link's address
            href, start = self.links.pop()
            if start == len(self.text) and _HTTP.match(href):
                self.text.append(href)

    def handle_data(self, data):
        self.text.append(data)


def shape(html_text: str, images_as_source: bool = False) -> tuple[list[str], str]:
    """(the element names in order, without a/img/div; the text with whitespace runs as one
    space). ``images_as_source``: for markdown-it's reference HTML, with the app's policy
    applied to its text (an image as its source text, an empty http(s) link as its address)."""
    p = _Shape(images_as_source)
    p.feed(html_text)
    p.close()
    return p.tags, " ".join("".join(p.text).split())
