"""Markdown a hostile reply could send to make the browser fetch a URL, render HTML, LaTeX or
colours: the known bypasses (issues 23 and 35 among them) and variants on each trick.
``payloads(url)`` names each one; ``url`` is where a leak would go (the browser test points it
at a request logger)."""
from __future__ import annotations


def _nested_list(depth: int, leaf: str) -> str:
    return "".join("  " * i + "- a\n" for i in range(depth)) + "  " * depth + "- " + leaf + "\n"


def payloads(url: str) -> dict[str, str]:
    img = f"![x]({url})"
    p = {
        # the known bypasses, as found
        "footnote": f"See[^1].\n\n[^1]: {img}",
        "quote-20": "> " * 20 + img,
        "list-9": _nested_list(9, img),
        # depth
        "quote-200": "> " * 200 + img,
        "list-60": _nested_list(60, img),
        "quote-list-40": "> - " * 40 + img,
        "list-quote-code": "- > - " * 25 + f"`a` {img} `b`",
        "ordered-deep": "".join("   " * i + "1. a\n" for i in range(30)) + "   " * 30 + "1. " + img,
        # footnotes and reference definitions
        "footnote-ref-image": f"a[^n]\n\n[^n]: see ![x][r]\n\n[r]: {url}\n",
        "footnote-indented": f"a[^n]\n\n[^n]: first\n\n    {img}\n",
        "footnote-deep": "> " * 25 + f"a[^n]\n\n[^n]: {img}",
        "reference": f"![x][r]\n\n[r]: {url}\n",
        "reference-shortcut": f"![r]\n\n[r]: <{url}> \"t\"\n",
        "reference-collapsed": f"![r][]\n\n[r]: {url}\n",
        "reference-in-quote": f"> ![x][r]\n>\n> [r]: {url}\n",
        "reference-label-image": f"[![x]({url})]: {url}\n\n[![x]({url})]\n",
        # HTML (Streamlit shows it as text; the sanitiser escapes it too)
        "html-img": f'<img src="{url}">',
        "html-block": f"<div>\n\n{img}\n\n</div>",
        "html-details": f"<details>\n<summary>s</summary>\n\n{img}\n\n</details>",
        "html-pre": f"<pre>\n\n```\n{img}\n```\n\n</pre>",
        "html-picture": f'<picture><source srcset="{url}"><img src="{url}"></picture>',
        "html-comment": f"<!--\n\n-->{img}",
        "html-deep": "> " * 30 + f'<img src="{url}">',
        "html-style": f"<style>body{{background:url({url})}}</style>",
        # entities and escapes
        "entity-bang": f"&#33;[x]({url}) &excl;[x]({url}) &#x21;[x]({url})",
        "entity-bracket": f"!&#91;x]({url}) !&lbrack;x]({url})",
        "entity-html": f"&lt;img src={url}&gt;",
        "even-backslashes": f"\\\\{img} \\\\\\\\{img}",
        "escaped-backtick": f"\\`x {img} `\n",
        # autolinks
        "autolink": f"<{url}>",
        "autolink-image": f"![x](<{url}>)",
        "autolink-in-image": f"![<{url}>]({url})",
        # tables
        "table": f"| a | b |\n|---|---|\n| {img} | `c` |\n",
        "table-code-pipe": f"| a |\n|---|\n| `a\\|b` {img} |\n",
        "table-then-fence": f"| a |\n|---|\n```\n{img}\n```\n",
        "table-deep": "> " * 25 + f"| a |\n" + "> " * 25 + "|---|\n" + "> " * 25 + f"| {img} |\n",
        # code that a dialect might not see as code
        "fence-in-list": f"- a\n\n  ```\n  {img}\n  ```\n",
        "fence-after-text": f"text\n```\n{img}\n```\n",
        "fence-deep": "> " * 30 + "```\n" + "> " * 30 + img + "\n" + "> " * 30 + "```\n",
        "indented-code": f"para\n\n    {img}\n",
        "span-across-blocks": f"`a\n\n{img}\n\n`\n",
        "span-backslash": f"`a\\`{img}`",
        "fence-unclosed-info": f"```x`\n{img}\n",
        "top-fence-then-image": f"```\ncode\n```\n{img}",
        # top-level fences are kept byte for byte: prove no container can hold one
        "footnote-then-fence": f"a[^1]\n\n[^1]: note\n\n```\n{img}\n```\n",
        "list-then-fence": f"- a\n\n```\n{img}\n```\n",
        "quote-then-fence": f"> a\n\n```\n{img}\n```\n",
        "html-then-fence": f"<div>\n\n```\n{img}\n```\n\n</div>\n",
        "tilde-fence-in-backticks": f"~~~\n```\n~~~\n{img}\n",
        # structure
        "image-in-link": f"[{img}](http://example.invalid/l)",
        "image-in-emphasis": f"**{img}** _{img}_ ~~{img}~~",
        "image-two-lines": f"a\n![x\ny]({url})\nb",
        "image-title": f'![x]({url} "title")',
        "heading": f"# {img}\n\n{img}\n===\n",
        "cr-lines": f"a\r\r```\r{img}\r```\r",
        "line-separator": f"a\u2028\n\n```\n\u2028\n```\n{img}",
        "form-feed-blank": f"| a |\n|---|\n\x0c\n```\n{img}\n```\n",
        # LaTeX and Streamlit directives, also deep
        "latex": f"$x^2$ and $$\\href{{{url}}}{{y}}$$ and $\\includegraphics{{{url}}}$",
        "latex-deep": "> " * 30 + "$x^2$ costs $5",
        "latex-list-deep": _nested_list(12, "$x^2$ and $y$"),
        "directive": ":red[stop] :blue-background[bg] :orange-badge[b]",
        "directive-deep": "> " * 30 + ":red[stop]",
        "directive-list-deep": _nested_list(12, ":green[go] :red[" + img + "]"),
    }
    # an HTML block whose next line opens a fence hides where the fences are from a
    # design that escapes the original text around a parse (the "<" escaped, the block gone)
    for name, tag in (("div", "<div>"), ("comment", "<!--"), ("pre", "<pre>"), ("p", "<p>"),
                      ("table", "<table>"), ("details", "<details>")):
        p[f"html-{name}-fence"] = f"{tag}\n```\n\n```\n{img}\n```\n"
    p["html-fence-in-quote"] = "> <div>\n> ```\n>\n> ```\n> " + img + "\n> ```\n"
    p["html-fence-in-list"] = f"- <pre>\n  ```\n\n  ```\n  {img}\n  ```\n"
    p["html-fence-tilde"] = f"<details>\n~~~\n\n~~~\n{img}\n~~~\n"
    # LaTeX and directives in GFM table cells (cells split at "|" before code spans)
    p["table-latex-directive"] = "| a | b |\n|---|---|\n| $x^2$ | :red[stop] |\n"
    p["table-split-code-span"] = "| a | b |\n|---|---|\n| `x | $y^2$ ` | :red[z] `|` |\n"
    p["table-image-after-pipe-code"] = f"| a |\n|---|\n| `|` {img} `|` |\n"
    # a math fence (Streamlit renders it with KaTeX)
    p["math-fence"] = f"```math\n\\href{{{url}}}{{x}}\n```\n"
    p["math-fence-in-list"] = "- ```math\n  x^2\n  ```\n"
    p["math-fence-tilde"] = "~~~ math\nx^2\n~~~\n"
    # issue 35: an HTML block that ends on its own line (comment, <pre>, <?, <!X, CDATA,
    # <script>), then in the same tight list item an ordered list not starting at 1. Written
    # back as Markdown, the escaped HTML is a paragraph that such a list cannot interrupt: it
    # becomes lazy paragraph text, and the fenced code below it live Markdown.
    fenced = f"```\n     {img}\n     ```\n"
    for name, opener in (("comment", "<!-- c -->"), ("pre", "<pre>x</pre>"), ("pi", "<?x?>"),
                         ("decl", "<!X>"), ("cdata", "<![CDATA[x]]>"),
                         ("script", "<script>x</script>"), ("style", "<style>x</style>")):
        p[f"lazy-{name}"] = f"- {opener}\n  2. " + fenced
    p["lazy-paren"] = "- <!-- c -->\n  5) " + fenced
    p["lazy-two-items"] = "- <!-- c -->\n  2. a\n  3. " + fenced
    p["lazy-quote"] = f"> - <!-- c -->\n>   2. ```\n>      {img}\n>      ```\n"
    p["lazy-nested"] = f"- a\n  - <!-- c -->\n    9. ```\n       {img}\n       ```\n"
    p["lazy-latex-directive"] = "- <!-- c -->\n  2. ```\n     $x^2$ :red[stop]\n     ```\n"
    # issue 35: e-mail addresses and mailto: autolinks (GFM links them), Streamlit's shortcodes
    p["email"] = "write to someone@example.com or some.one+x@mail.example.org today"
    p["email-autolink"] = "<someone@example.com>"
    p["mailto-autolink"] = "<mailto:someone@example.com> and [m](mailto:a@example.com)"
    p["email-in-list"] = "- a@example.com\n  - b@example.com\n"
    p["shortcode"] = "Made with :streamlit: and :smile: :material/home:"
    p["shortcode-deep"] = "> " * 12 + ":streamlit: " + "`x` :streamlit:"
    p["directive-nested"] = ":red[:blue-background[x] $y$]"
    p["latex-display"] = f"$$\n\\href{{{url}}}{{x}}\n$$\n"
    p["latex-emphasis"] = "**$x^2$** and _$\\frac{1}{2}$_"
    return p


# Markdown that must stay readable: its sanitised form renders the same.
ORDINARY = {
    "bold": "Some **bold** and _it_ text, ~~struck~~.",
    "list": "- one\n- two\n  - nested\n\n1. first\n2. second\n",
    "loose-list": "- one\n\n  more of one\n\n- two\n",
    "code": "```python\nif a < b and x != y:\n    print(f'${a}')\n```\n",
    "md-example": "Use this:\n\n```markdown\n![alt](pic.png)\n```\n",
    "long-fence": "````md\n```\ninner\n```\n````\n",
    "link": "See [the docs](https://example.com/a?b=1&c=2) now!",
    "span": "Run `echo $HOME` or `a<b` or `` a`b ``.",
    "compare": "if a < b then $5 costs 10:30 (roughly) & more",
    "heading": "# Title\n\nText under it.\n\n## Part *two*\n",
    "quote": "> quoted\n> > nested\n\nafter",
    "table": "| name | value |\n|:---|---:|\n| `a|b` | **1** |\n| c | 2 |\n",
    "rule": "above\n\n---\n\nbelow",
    "breaks": "line one  \nline two\\\nline three",
    "task": "- [ ] todo\n- [x] done\n",
    "indented-code": "text\n\n    code line\n",
    "punctuation": "Hello, world! a_b_c, 2*3*4 = 24; \"quotes\" and 'single' #tag @me",
}
