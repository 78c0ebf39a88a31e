"""End to end in a real browser: ``streamlit run app.py`` on the tiny model, driven by headless
Debian Chromium through Playwright. Two messages, both replies, a slider, clear, a reply interrupted by the next message,
a second session waiting for the shared engine; screenshots go to test-artifacts/ (gitignored)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
START_TIMEOUT_S = 40
STEP_TIMEOUT_MS = 20_000
CURSOR = "▌"

pytestmark = pytest.mark.browser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chromium() -> str:
    return shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"streamlit exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=1) as r:
                if r.read().strip() == b"ok":
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"streamlit did not become healthy:\n{log.read_text()[-2000:]}")


@pytest.fixture
def app_url(tiny_model_dir, tmp_path):
    port = _free_port()
    log = tmp_path / "streamlit.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", QWEN_TRT_WORKER="process")   # the default
    cmd = [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"),
           "--server.headless", "true", "--server.address", "127.0.0.1", "--server.port", str(port),
           "--server.fileWatcherType", "none", "--browser.gatherUsageStats", "false",
           "--", "--model", str(tiny_model_dir), "--device", "cpu"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _wait_idle(page) -> None:
    page.wait_for_selector('[data-testid="stApp"][data-test-script-state="notRunning"]',
                           timeout=STEP_TIMEOUT_MS)


def _send(page, text: str) -> None:
    box = page.get_by_test_id("stChatInput").locator("textarea")
    box.fill(text)
    box.press("Enter")


def test_chat_in_a_real_browser(app_url):
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    expect.set_options(timeout=STEP_TIMEOUT_MS)       # the first page view loads the model
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(STEP_TIMEOUT_MS)
            page.goto(app_url)
            page.wait_for_selector('[data-testid="stApp"][data-test-connection-state="CONNECTED"]')
            expect(page.get_by_test_id("stChatInput")).to_be_visible()
            _wait_idle(page)
            sidebar = page.get_by_test_id("stSidebar")
            expect(sidebar).to_contain_text("torch")
            expect(sidebar).to_contain_text("Clear memory")

            max_len = sidebar.get_by_test_id("stSlider").nth(0)
            expect(max_len).to_contain_text("512")
            max_len.get_by_role("slider").focus()
            page.keyboard.press("Home")                # short replies keep this test quick
            expect(max_len).to_contain_text("128")
            _wait_idle(page)

            messages = page.get_by_test_id("stChatMessage")
            _send(page, "Hello, how are you today?")
            expect(messages).to_have_count(2)
            expect(messages.nth(1)).to_contain_text("tokens/s")
            _wait_idle(page)
            _send(page, "Please explain <b>tensors</b> ![pic](http://127.0.0.1:9/leak.png)")
            expect(messages).to_have_count(4)
            expect(messages.nth(3)).to_contain_text("tokens/s")
            _wait_idle(page)
            expect(messages.nth(0)).to_contain_text("Hello, how are you today?")
            expect(messages.nth(2)).to_contain_text("Please explain <b>tensors</b>")  # as text
            assert messages.nth(2).locator("b").count() == 0
            # A Markdown image becomes inert text + link: the browser fetches nothing.
            expect(messages.nth(2)).to_contain_text("!pic")
            assert messages.nth(2).get_by_test_id("stMarkdownContainer").locator("img").count() == 0
            for i in (1, 3):
                body = messages.nth(i).get_by_test_id("stMarkdownContainer").first.inner_text()
                assert body.strip(), f"reply {i} is empty"

            temp = sidebar.get_by_test_id("stSlider").nth(1)
            expect(temp).to_contain_text("0.70")
            temp.get_by_role("slider").focus()
            page.keyboard.press("ArrowRight")
            expect(temp).to_contain_text("0.75")
            _wait_idle(page)
            expect(messages).to_have_count(4)          # moving a slider keeps the history
            page.screenshot(path=str(ARTIFACTS / "app-chat.png"), full_page=True)

            sidebar.get_by_role("button", name="Clear memory").click()
            expect(messages).to_have_count(0)
            _wait_idle(page)
            page.screenshot(path=str(ARTIFACTS / "app-cleared.png"))

            # A long greedy reply (the tiny model never stops by itself at temperature 0),
            # interrupted by the next message: the partial reply stays, marked interrupted.
            temp.get_by_role("slider").focus()
            page.keyboard.press("Home")
            expect(temp).to_contain_text("0.00")
            _wait_idle(page)
            max_len.get_by_role("slider").focus()
            page.keyboard.press("End")                 # 4096 would leave no room for a prompt
            page.keyboard.press("ArrowLeft")
            expect(max_len).to_contain_text("4032")
            _wait_idle(page)
            _send(page, "Write a very long story")
            expect(messages).to_have_count(2)
            expect(messages.nth(1)).to_contain_text(CURSOR)       # still streaming
            page.screenshot(path=str(ARTIFACTS / "app-streaming.png"))
            _send(page, "Stop, shorter please")
            expect(messages).to_have_count(4)
            expect(messages.nth(1)).to_contain_text("interrupted")
            expect(messages.nth(1)).not_to_contain_text(CURSOR)
            expect(messages.nth(3)).to_contain_text(CURSOR)

            # A second browser session meanwhile waits for the shared engine, visibly.
            other = browser.new_page(viewport={"width": 1280, "height": 900})
            other.goto(app_url)
            expect(other.get_by_test_id("stChatInput")).to_be_visible()
            _wait_idle(other)
            _send(other, "Am I in the queue?")
            other_messages = other.get_by_test_id("stChatMessage")
            expect(other_messages).to_have_count(2)
            expect(other_messages.nth(1)).to_contain_text("Waiting for the engine: 1 request ahead")
            other.screenshot(path=str(ARTIFACTS / "app-waiting.png"))

            # Clear while the first session's reply streams: it stops, its page empties at
            # once, and the engine goes straight to the waiting session.
            sidebar.get_by_role("button", name="Clear memory").click()
            expect(messages).to_have_count(0)
            expect(other_messages.nth(1)).to_contain_text("tokens/s")
            expect(other_messages.nth(1)).to_contain_text("for the engine")   # "waited N s ..."
            expect(other_messages.nth(1)).not_to_contain_text("Waiting for the engine")
            _wait_idle(page)
            _wait_idle(other)
        finally:
            browser.close()
