"""The app's safe HTML against a real browser: headless Chromium, one launch for the module.

1. A tiny page renders every payload of the hostile corpus twice: as the app shows it
   (``st.html(markdown_html(...))``) and raw through ``st.markdown`` (the control). Each payload's
   URL points at a request logger on 127.0.0.1 with a path naming the payload and the variant.
   The raw controls prove the renderer and the logger work (they fetch, and show images, LaTeX,
   colours and mailto links); the app's variants must cause no request, and the elements and
   attributes Chromium builds from them must be inside the allow-list.
2. The real app (``streamlit run app.py``) on a hostile OpenAI-compatible backend: a chat
   seeded with issue 35's payloads, one turn each, user and assistant (drawn as a reload draws
   it), then replies streamed from the backend in 9-character chunks (the issue families, then
   the whole corpus), then a reload. No request for the logger, no image or media request at
   all, nothing outside the allow-list in the DOM, no image, no mailto link.
"""
from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from markdown_check import TAGS, WRAPPER_CLASS
from markdown_payloads import ORDINARY, payloads
from test_browser_e2e import (CHROMIUM_ARGS, ROOT, STEP_TIMEOUT_MS, _chromium, _free_port,
                              _send, _stop, _wait_chat_ready, _wait_healthy, _wait_idle)

pytestmark = pytest.mark.browser

APP = '''
import json
import streamlit as st
from qwen_trt import settings
from qwen_trt.ui.text import PAGE_CSS, markdown_html

st.html(PAGE_CSS)
doc = json.loads(open(settings.get("QWEN_TRT_CORPUS")).read())
for i, (name, pair) in enumerate(doc["corpus"].items()):
    with st.container(key=f"s{i}"):
        st.html(markdown_html(pair["s"]))
    with st.container(key=f"r{i}"):
        st.markdown(pair["r"])
for i, text in enumerate(doc["ordinary"].values()):
    with st.container(key=f"os{i}"):
        st.html(markdown_html(text))
    with st.container(key=f"or{i}"):
        st.markdown(text)
st.markdown("corpus-done")
'''

# Every element Chromium built inside each app-HTML box, with its attributes, and what of the
# forbidden selectors matched there: {key: [[tag, [[attr, value]...]]...]} and {key: [selector]}.
ELEMENTS_JS = """els => Object.fromEntries(els.map(el => [el.dataset.key,
  Array.from(el.querySelectorAll('[data-testid="stHtml"] *')).map(e =>
    [e.tagName.toLowerCase(), Array.from(e.attributes).map(a => [a.name, a.value])])]))"""
FORBIDDEN = ("img", "svg", "picture", "source", "iframe", "video", "audio", "object", "embed",
             "style", "details", "input", ".katex", "[style]", "[class*=badge]", "a[href^=mailto]")
FORBIDDEN_JS = """(els, sels) => Object.fromEntries(els.map(el => [el.dataset.key,
  sels.filter(s => el.querySelector('[data-testid="stHtml"] ' + s))]))"""
# Scrolls each box into view in turn (lazy images load), in one round trip.
SCROLL_JS = """async els => { for (const e of els) { e.scrollIntoView();
  await new Promise(r => requestAnimationFrame(r)); } }"""


def _boxes(page, prefix: str) -> str:
    """A selector for the keyed containers whose key starts with ``prefix``; each gets its key
    as data-key."""
    page.evaluate("""p => document.querySelectorAll(`[class*="st-key-${p}"]`).forEach(e => {
      const k = [...e.classList].find(c => c.startsWith('st-key-'));
      e.dataset.key = k.slice(7); })""", prefix)
    return f'[class*="st-key-{prefix}"]'


def _inside_allow_list(found: dict) -> list:
    return [(key, tag, attr, value) for key, elements in found.items()
            for tag, attrs in elements for attr, value in attrs or [[None, None]]
            if tag not in TAGS or (attr is not None and not _allowed(tag, attr, value))]


ISSUE_35 = ("lazy-", "email", "mailto", "shortcode", "directive", "latex")
MUST_LEAK_RAW = ("footnote", "quote-20", "list-9", "reference", "table", "html-block")


def _allowed(tag: str, name: str, value: str) -> bool:
    if tag == "div" and name == "class":
        return value == WRAPPER_CLASS
    if tag == "a":
        return ((name == "href" and value.startswith(("http://", "https://")))
                or (name, value) in (("target", "_blank"), ("rel", "noopener noreferrer nofollow"),
                                     ("rel", "noopener noreferrer")))    # DOMPurify's, on _blank
    return (tag, name) in (("ol", "start"), ("th", "align"), ("td", "align"))


class _Logger(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self):   # noqa: N802 (http.server's name)
        self.seen.append(self.path)
        self.send_response(404)
        self.end_headers()

    do_HEAD = do_POST = do_GET

    def log_message(self, *args):
        pass


class _HostileOpenAI(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server whose replies are payloads: the user message names them
    (``replies``), and they are streamed in small chunks."""

    replies: dict[str, str] = {}
    protocol_version = "HTTP/1.1"

    def _json(self, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):   # noqa: N802
        self._json({"object": "list", "data": [{"id": "hostile", "object": "model",
                                                "max_model_len": 65536}]})

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = self.replies.get(req["messages"][-1]["content"], "no such payload")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        step = 9
        for i in range(0, len(text), step):
            chunk = {"choices": [{"index": 0, "delta": {"content": text[i:i + step]},
                                  "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.001)
        end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 10, "completion_tokens": len(text) // 4}}
        self.wfile.write(f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode())
        self.close_connection = True

    def log_message(self, *args):
        pass


def _serve(handler) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _streamlit(script, cwd, log, env, *app_args):
    cmd = [sys.executable, "-m", "streamlit", "run", str(script),
           "--server.headless", "true", "--server.address", "127.0.0.1",
           "--server.fileWatcherType", "none", "--browser.gatherUsageStats", "false",
           "--server.port", str(port := _free_port()), *(["--", *app_args] if app_args else [])]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log)
    except BaseException:
        _stop(proc)
        raise
    return proc, url


@pytest.fixture(scope="module")
def logger():
    """(base URL, the paths it was asked for)."""
    handler = type("Logger", (_Logger,), {"seen": []})
    server = _serve(handler)
    yield f"http://127.0.0.1:{server.server_address[1]}", handler.seen
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, logger, browser, hostile_app):
    """(page, corpus names, logged paths) after the page rendered everything. (The real app
    starts first: its first page view loads its engine meanwhile.)"""
    tmp = tmp_path_factory.mktemp("md-browser")
    base, seen = logger
    names = sorted(payloads("u"))
    corpus = {n: {"s": payloads(f"{base}/s/{n}")[n], "r": payloads(f"{base}/r/{n}")[n]}
              for n in names}
    (tmp / "corpus.json").write_text(json.dumps({"corpus": corpus, "ordinary": ORDINARY}))
    (tmp / "app.py").write_text(APP)
    proc, url = _streamlit(tmp / "app.py", tmp, tmp / "streamlit.log",
                           {"QWEN_TRT_CORPUS": str(tmp / "corpus.json")})
    page = browser.new_page(viewport={"width": 1280, "height": 2000})
    try:
        page.set_default_timeout(STEP_TIMEOUT_MS)
        page.goto(url)
        page.get_by_text("corpus-done").wait_for()
        _wait_idle(page)
        page.locator('[class*="st-key-"]').evaluate_all(SCROLL_JS)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(
                f"/r/{n}" in seen for n in MUST_LEAK_RAW):
            time.sleep(0.1)
        time.sleep(0.5)                      # let any late request arrive
        yield page, names, list(seen)
    finally:
        page.close()
        _stop(proc)


def test_raw_payloads_do_leak_in_this_renderer(rendered):
    _, _, seen = rendered
    assert {f"/r/{n}" for n in MUST_LEAK_RAW} <= set(seen), seen


def test_app_html_makes_no_request(rendered):
    _, names, seen = rendered
    assert [p for p in seen if p.startswith("/s/")] == []
    assert "html-div-fence" in names and "lazy-comment" in names and "shortcode" in names


def _app_boxes(page, names):
    """{payload name: key} of the app-HTML boxes (s0, s1, ...), with data-key set."""
    _boxes(page, "s")
    return {f"s{i}": n for i, n in enumerate(names)}


def test_what_chromium_builds_from_the_app_html_is_inside_the_allow_list(rendered):
    """Differential, in the browser: every element and attribute in the DOM."""
    page, names, _ = rendered
    keys = _app_boxes(page, names)
    found = page.locator('[class*="st-key-s"]').evaluate_all(ELEMENTS_JS)
    assert set(keys) <= set(found)
    assert _inside_allow_list({keys[k]: v for k, v in found.items() if k in keys}) == []


def test_app_html_renders_no_image_html_latex_colour_or_mail_link(rendered):
    page, names, _ = rendered
    keys = _app_boxes(page, names)
    found = page.locator('[class*="st-key-s"]').evaluate_all(FORBIDDEN_JS, list(FORBIDDEN))
    assert {keys[k]: v for k, v in found.items() if k in keys and v} == {}
    for name, shown in (("directive", ":red[stop]"), ("directive", ":orange-badge[b]"),
                        ("latex-deep", "$x^2$ costs $5"), ("shortcode", ":streamlit:"),
                        ("email", "someone@example.com"), ("lazy-comment", "![x]("),
                        ("html-div-fence", "![x](")):
        assert shown in page.locator(f".st-key-s{names.index(name)}").inner_text(), name


def test_raw_controls_show_what_the_checks_look_for(rendered):
    page, names, _ = rendered
    raw = {n: page.locator(f".st-key-r{names.index(n)}") for n in
           ("directive", "latex", "list-9", "quote-20", "shortcode", "email", "mailto-autolink")}
    assert raw["latex"].locator(".katex").count() > 0
    assert raw["directive"].locator("span[style*=color]").count() > 0, raw["directive"].inner_html()
    assert raw["list-9"].locator("img").count() == 1 and raw["quote-20"].locator("img").count() == 1
    assert raw["shortcode"].locator("img").count() > 0, raw["shortcode"].inner_html()
    assert raw["email"].locator("a[href^=mailto]").count() > 0
    assert raw["mailto-autolink"].locator("a[href^=mailto]").count() > 0


def test_ordinary_markdown_stays_readable(rendered):
    """Ours and Streamlit's rendering of ordinary Markdown show the same text, with the
    formatting elements it needs."""
    page, _, _ = rendered
    norm = lambda s: " ".join(s.replace("[ ] ", "").replace("[x] ", "").split())  # noqa: E731
    needs = {"bold": "strong", "list": "ol li", "code": "pre code", "link": "a[href]",
             "heading": "h1", "quote": "blockquote blockquote", "table": "table td",
             "rule": "hr", "breaks": "br", "span": "code"}
    for i, name in enumerate(ORDINARY):
        mine = page.locator(f".st-key-os{i}")
        raw = page.locator(f".st-key-or{i}").inner_text()
        assert norm(mine.inner_text()) == norm(raw), name
        if name in needs:
            assert mine.locator(needs[name]).count() > 0, name


# -- the real app on a hostile backend --------------------------------------------------------


def _seed(names: list[str], user: dict, assistant: dict) -> dict:
    messages, notes = [], []
    for n in names:
        messages += [{"role": "user", "content": user[n], "interrupted": False},
                     {"role": "assistant", "content": assistant[n], "interrupted": False}]
        notes.append({"footer": f"payload {n}", "dropped_turns": 0, "metrics": {},
                      "params": {}})
    return {"system_prompt": None, "messages": messages, "notes": notes}


@pytest.fixture(scope="module")
def hostile_app(tmp_path_factory, logger, browser):
    """``streamlit run app.py`` on a hostile OpenAI-compatible backend: (url, seeded chat id,
    the messages that make the backend send payloads)."""
    from qwen_trt.ui.store import new_session_id

    tmp = tmp_path_factory.mktemp("hostile-app")
    base, _ = logger
    names = sorted(payloads("u"))
    issue = [n for n in names if n.startswith(ISSUE_35)]
    streamed = payloads(f"{base}/b")
    handler = type("Hostile", (_HostileOpenAI,), {"replies": {
        "send the issue-35 payloads": "\n\n---\n\n".join(streamed[n] for n in issue),
        "send the whole corpus": "\n\n---\n\n".join(streamed[n] for n in names)}})
    backend = _serve(handler)
    sid = new_session_id()
    (tmp / f"{sid}.json").write_text(json.dumps(_seed(        # the whole corpus is streamed
        issue, payloads(f"{base}/u"), payloads(f"{base}/a"))))
    proc, url = _streamlit(ROOT / "app.py", ROOT, tmp / "streamlit.log",
                           {"QWEN_TRT_APP_SEED_DIR": str(tmp)}, "--backend", "openai",
                           "--base-url", f"http://127.0.0.1:{backend.server_address[1]}/v1")
    warm = browser.new_page()
    try:
        warm.goto(url)            # the app loads its engine (imports) while the corpus renders
        yield url, sid, len(issue), list(handler.replies)
    finally:
        warm.close()
        _stop(proc)
        backend.shutdown()


def _check_page(page, requests: list, seen: list, base: str, where: str) -> None:
    page.evaluate("""() => document.querySelectorAll('[data-testid="stChatMessage"]')
                           .forEach((e, i) => { e.dataset.key = 'm' + i; })""")
    messages = page.locator('[data-testid="stChatMessage"]')
    messages.evaluate_all(SCROLL_JS)
    found = messages.evaluate_all(FORBIDDEN_JS, list(FORBIDDEN))
    assert {k: v for k, v in found.items() if v} == {}, where
    assert _inside_allow_list(messages.evaluate_all(ELEMENTS_JS)) == [], where
    time.sleep(0.5)                                  # let any late request arrive
    assert [p for p in seen if p.startswith(("/u/", "/a/", "/b/"))] == [], where
    assert [r for r in requests if r[0] in ("image", "media") or r[1].startswith(base)] == [], \
        where


def test_the_real_app_on_a_hostile_backend_fetches_nothing(hostile_app, logger, browser):
    from playwright.sync_api import expect

    url, sid, seeded, prompts = hostile_app
    base, seen = logger
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    requests: list[tuple[str, str]] = []
    page.on("request", lambda r: requests.append((r.resource_type, r.url)))
    try:
        page.set_default_timeout(STEP_TIMEOUT_MS)
        expect.set_options(timeout=STEP_TIMEOUT_MS)
        # the issue's payloads, one turn each, drawn as a reload draws a chat (all turns shown)
        page.goto(f"{url}/?chat={sid}")
        _wait_chat_ready(page)
        _wait_idle(page)
        requests.clear()                             # the page's own assets are not the point
        page.get_by_role("button", name="earlier turns").click()
        messages = page.get_by_test_id("stChatMessage")
        expect(messages).to_have_count(2 * seeded)
        _wait_idle(page)
        _check_page(page, requests, seen, base, "seeded history")
        page.get_by_test_id("stSidebar").get_by_role("button", name="Clear memory").click()
        expect(messages).to_have_count(0)
        _wait_idle(page)
        # replies streamed by the hostile backend in 9-character chunks
        for n, prompt in enumerate(prompts, 1):
            _send(page, prompt)
            expect(messages).to_have_count(2 * n)
            expect(messages.last).to_contain_text("tokens/s")
            _wait_idle(page)
        assert "someone@example.com" in messages.last.inner_text()      # it did arrive
        _check_page(page, requests, seen, base, "streamed")
        page.reload()                                # and again after a reload
        _wait_chat_ready(page)
        _wait_idle(page)
        expect(messages).to_have_count(2 * len(prompts))
        _check_page(page, requests, seen, base, "reloaded")
    finally:
        page.close()
