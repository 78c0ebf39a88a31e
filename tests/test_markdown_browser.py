"""The sanitiser against Streamlit's real Markdown renderer in headless Chromium.

One ``streamlit run`` of a tiny page renders every payload of the hostile corpus twice with
``st.markdown``: sanitised (what the app does) and raw (the control). Each payload's URL points
at a request logger on 127.0.0.1 with a path naming the payload and the variant. The raw
controls prove the renderer and the logger work (the issue's payloads do make Chromium fetch);
the sanitised variants must cause no request at all, and render no image, HTML, LaTeX or
coloured directive.
"""
from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from markdown_payloads import ORDINARY, payloads
from test_browser_e2e import CHROMIUM_ARGS, ROOT, STEP_TIMEOUT_MS, _chromium, _free_port, _wait_healthy

pytestmark = pytest.mark.browser

APP = '''
import json
import streamlit as st
from qwen_trt import settings
from qwen_trt.ui.text import sanitize_markdown

doc = json.loads(open(settings.get("QWEN_TRT_CORPUS")).read())
for i, (name, pair) in enumerate(doc["corpus"].items()):
    with st.container(key=f"s{i}"):
        st.markdown(sanitize_markdown(pair["s"]))
    with st.container(key=f"r{i}"):
        st.markdown(pair["r"])
for i, text in enumerate(doc["ordinary"].values()):
    with st.container(key=f"os{i}"):
        st.markdown(sanitize_markdown(text))
    with st.container(key=f"or{i}"):
        st.markdown(text)
st.markdown("corpus-done")
'''

# Reads each rendered box back: its text and the tags in it, in order (no attributes).
SHAPE_JS = """el => ({text: el.innerText,
  tags: Array.from(el.querySelectorAll('*')).map(e => e.tagName).join(' ')})"""

ISSUE_PAYLOADS = ("footnote", "quote-20", "list-9")
MUST_LEAK_RAW = ISSUE_PAYLOADS + ("reference", "table", "html-block")


class _Logger(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self):   # noqa: N802 (http.server's name)
        self.seen.append(self.path)
        self.send_response(404)
        self.end_headers()

    do_HEAD = do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """(page, corpus names, logged paths) after the page rendered everything."""
    from playwright.sync_api import sync_playwright

    tmp = tmp_path_factory.mktemp("md-browser")
    handler = type("Logger", (_Logger,), {"seen": []})
    logger = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=logger.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{logger.server_address[1]}"
    names = sorted(payloads("u"))
    corpus = {n: {"s": payloads(f"{base}/s/{n}")[n], "r": payloads(f"{base}/r/{n}")[n]}
              for n in names}
    (tmp / "corpus.json").write_text(json.dumps({"corpus": corpus, "ordinary": ORDINARY}))
    (tmp / "app.py").write_text(APP)
    port = _free_port()
    log = tmp / "streamlit.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", QWEN_TRT_CORPUS=str(tmp / "corpus.json"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "streamlit", "run", str(tmp / "app.py"),
           "--server.headless", "true", "--server.address", "127.0.0.1", "--server.port", str(port),
           "--server.fileWatcherType", "none", "--browser.gatherUsageStats", "false"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url, log)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 2000})
                page.set_default_timeout(STEP_TIMEOUT_MS)
                page.goto(url)
                page.get_by_text("corpus-done").wait_for()
                page.wait_for_selector('[data-testid="stApp"][data-test-script-state="notRunning"]')
                for i in range(len(names)):          # bring each into view (lazy images load)
                    for kind in "sr":
                        page.locator(f".st-key-{kind}{i}").scroll_into_view_if_needed()
                for i in range(len(ORDINARY)):
                    for kind in ("os", "or"):
                        page.locator(f".st-key-{kind}{i}").scroll_into_view_if_needed()
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and not all(
                        f"/r/{n}" in handler.seen for n in MUST_LEAK_RAW):
                    time.sleep(0.1)
                time.sleep(0.5)                      # let any late request arrive
                yield page, names, list(handler.seen)
            finally:
                browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        logger.shutdown()


def test_raw_payloads_do_leak_in_this_renderer(rendered):
    _, _, seen = rendered
    assert {f"/r/{n}" for n in MUST_LEAK_RAW} <= set(seen), seen


def test_sanitised_payloads_make_no_request(rendered):
    _, names, seen = rendered
    assert [p for p in seen if p.startswith("/s/")] == []
    assert "html-div-fence" in names                  # the HTML-opener-then-fence payloads are in the corpus


def test_sanitised_payloads_link_only_to_http(rendered):
    page, names, _ = rendered
    for i, name in enumerate(names):
        hrefs = page.locator(f".st-key-s{i} a[href]").evaluate_all(
            "els => els.map(e => e.getAttribute('href'))")
        # "#..." are Streamlit's own heading anchors
        assert all(h.startswith(("http://", "https://", "#")) for h in hrefs), (name, hrefs)


def test_ordinary_markdown_renders_the_same_sanitised(rendered):
    page, _, _ = rendered
    for i, name in enumerate(ORDINARY):
        mine = page.locator(f".st-key-os{i}").evaluate(SHAPE_JS)
        raw = page.locator(f".st-key-or{i}").evaluate(SHAPE_JS)
        assert mine == raw, name


def test_sanitised_payloads_render_no_image_html_latex_or_colour(rendered):
    page, names, _ = rendered
    for i, name in enumerate(names):
        box = page.locator(f".st-key-s{i}")
        for sel in ("img", "picture", "source", "iframe", "video", "audio", "object", "embed",
                    "style", "details", ".katex", "span[style*=color]", "[class*=badge]"):
            assert box.locator(sel).count() == 0, (name, sel, box.inner_html()[:500])
    directive = page.locator(f".st-key-s{names.index('directive')}").inner_text()
    assert ":red[stop]" in directive and ":orange-badge[b]" in directive
    fenced = page.locator(f".st-key-s{names.index('html-div-fence')} code").inner_text()
    assert "![x](" in fenced                           # the image line, shown as code
    latex = page.locator(f".st-key-s{names.index('latex-deep')}").inner_text()
    assert "$x^2$ costs $5" in latex


def test_raw_controls_show_what_the_checks_look_for(rendered):
    page, names, _ = rendered
    raw = {n: page.locator(f".st-key-r{names.index(n)}") for n in
           ("directive", "latex", "list-9", "quote-20")}
    assert raw["latex"].locator(".katex").count() > 0
    assert raw["directive"].locator("span[style*=color]").count() > 0, raw["directive"].inner_html()
    assert raw["list-9"].locator("img").count() == 1 and raw["quote-20"].locator("img").count() == 1
