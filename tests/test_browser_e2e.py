"""End to end in a real browser: ``streamlit run app.py`` on the tiny model, driven by headless
Debian Chromium through Playwright. One server for the module. Two messages, both replies, a
slider, clear, Stop, a slider moved mid-reply, a second session waiting for the shared engine,
regenerate, edit, the transcript download, a reload (the chat and the sliders come back);
screenshots go to test-artifacts/ (gitignored)."""
from __future__ import annotations

import json
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
# Bounds for readiness signals, sized for a loaded 2-core CI machine (the waits end as soon as
# the signal comes): the server answering its health check, the model loaded (the chat box
# drawn; ~33 s seen on a busy machine), and each step of a test.
START_TIMEOUT_S = 120
MODEL_READY_TIMEOUT_MS = 300_000
STEP_TIMEOUT_MS = 60_000
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


@pytest.fixture(scope="module")
def app_started(tiny_model_dir, tmp_path_factory):
    """One ``streamlit run app.py`` for the module: (url, seed folder of its reload store,
    its log file)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("streamlit") / "streamlit.log"
    seed_dir = tmp_path_factory.mktemp("seed")          # the latency smoke seeds chats here
    env = dict(os.environ, PYTHONUNBUFFERED="1", QWEN_TRT_WORKER="process",   # the default
               QWEN_TRT_APP_SEED_DIR=str(seed_dir))
    cmd = [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"),
           "--server.headless", "true", "--server.address", "127.0.0.1", "--server.port", str(port),
           "--server.fileWatcherType", "none", "--browser.gatherUsageStats", "false",
           "--", "--model", str(tiny_model_dir), "--device", "cpu"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url, log)
        yield url, str(seed_dir), log
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="module")
def app_server(app_started):
    """(url, seed folder of its reload store)."""
    return app_started[:2]


@pytest.fixture(scope="module")
def app_url(app_server):
    return app_server[0]


def _wait_chat_ready(page) -> None:
    """Until the chat box is drawn (the first page view waits for the model to load), or the
    page shows an error (then fail with it)."""
    page.wait_for_selector('[data-testid="stChatInput"], [data-testid="stException"], '
                           '[data-testid="stAlertContentError"]', timeout=MODEL_READY_TIMEOUT_MS)
    error = page.locator('[data-testid="stException"], [data-testid="stAlertContentError"]')
    assert error.count() == 0, error.first.inner_text()


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
            _wait_chat_ready(page)
            _wait_idle(page)
            expect(page.get_by_text("tiny random demo model")).to_be_visible()   # said on the page
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
            # A Markdown image shows as the text it is: the browser fetches nothing.
            expect(messages.nth(2)).to_contain_text("![pic](http://127.0.0.1:9/leak.png)")
            assert messages.nth(2).get_by_test_id("stHtml").locator("img").count() == 0
            for i in (1, 3):
                body = messages.nth(i).get_by_test_id("stHtml").first.inner_text()
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
            # stopped with the chat box's Stop: the partial reply stays, marked stopped.
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
            page.get_by_role("button", name="Stop").click()
            _wait_idle(page)
            expect(messages.nth(1)).to_contain_text("stopped")       # the footer, at once
            expect(messages.nth(1)).not_to_contain_text(CURSOR)
            page.screenshot(path=str(ARTIFACTS / "app-stopped.png"))
            _send(page, "Another long one")
            expect(messages).to_have_count(4)
            expect(messages.nth(1)).to_contain_text("stopped")
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


def _markdown_text(message) -> str:
    return message.get_by_test_id("stHtml").first.inner_text()


def test_stop_slider_mid_reply_regenerate_edit_download_reload(app_started):
    from playwright.sync_api import expect, sync_playwright

    app_url, _, log = app_started
    ARTIFACTS.mkdir(exist_ok=True)
    expect.set_options(timeout=STEP_TIMEOUT_MS)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(STEP_TIMEOUT_MS)
            page.goto(app_url)
            _wait_chat_ready(page)
            _wait_idle(page)
            assert "chat=" in page.url                 # the reload key is in the URL
            sidebar = page.get_by_test_id("stSidebar")
            max_len, temp = (sidebar.get_by_test_id("stSlider").nth(i) for i in (0, 1))
            temp.get_by_role("slider").focus()
            page.keyboard.press("Home")
            expect(temp).to_contain_text("0.00")
            max_len.get_by_role("slider").focus()
            page.keyboard.press("End")
            page.keyboard.press("ArrowLeft")
            expect(max_len).to_contain_text("4032")
            _wait_idle(page)

            messages = page.get_by_test_id("stChatMessage")
            _send(page, "Write a very long story")
            expect(messages.nth(1)).to_contain_text(CURSOR)
            # Moving a slider mid-reply reruns only the settings panel: the reply goes on.
            before = len(_markdown_text(messages.nth(1)))
            top_p = sidebar.get_by_test_id("stSlider").nth(2)
            top_p.get_by_role("slider").focus()
            page.keyboard.press("ArrowLeft")
            expect(top_p).to_contain_text("0.75")
            page.wait_for_function(
                "n => document.querySelectorAll('[data-testid=\"stChatMessage\"]')[1]"
                ".innerText.length > n + 20", arg=before)
            expect(messages.nth(1)).to_contain_text(CURSOR)
            expect(messages.nth(1)).not_to_contain_text("interrupted")
            page.get_by_role("button", name="Stop").click()
            _wait_idle(page)
            expect(messages.nth(1)).to_contain_text("stopped")
            partial = _markdown_text(messages.nth(1)).strip()
            assert partial and CURSOR not in partial
            # A slider moved after the last reply is kept too (saved on change).
            temp.get_by_role("slider").focus()
            page.keyboard.press("ArrowRight")
            expect(temp).to_contain_text("0.05")
            _wait_idle(page)

            # Reload: the same chat comes back, the reply marked stopped, the sliders as set.
            page.reload()
            expect(page.get_by_test_id("stChatInput")).to_be_visible()
            _wait_idle(page)
            expect(messages).to_have_count(2)
            expect(messages.nth(1)).to_contain_text("stopped")
            expect(temp).to_contain_text("0.05")
            expect(top_p).to_contain_text("0.75")                  # moved mid-reply
            expect(max_len).to_contain_text("4032")
            # the kept reply is what was shown, plus any tokens still in flight at the Stop
            assert _markdown_text(messages.nth(1)).strip().startswith(partial)
            page.screenshot(path=str(ARTIFACTS / "app-reloaded.png"))
            # the restored settings make no duplicate-value warning
            assert "created with a default value" not in log.read_text()

            # While the regenerated reply streams, the old reply's footer is gone.
            page.get_by_role("button", name="Regenerate").click()
            expect(messages.nth(1)).to_contain_text(CURSOR)
            streaming = messages.nth(1).inner_text()
            assert "stopped" not in streaming and "first token" not in streaming, streaming
            page.get_by_role("button", name="Stop").click()
            _wait_idle(page)
            expect(messages.nth(1)).to_contain_text("stopped")

            max_len.get_by_role("slider").focus()       # short replies from here on
            page.keyboard.press("Home")
            expect(max_len).to_contain_text("128")
            _wait_idle(page)
            page.get_by_role("button", name="Regenerate").click()
            expect(messages.nth(1)).not_to_contain_text("stopped")
            _wait_idle(page)
            expect(messages.nth(1)).to_contain_text("tokens/s")
            expect(messages).to_have_count(2)           # replaced, not added

            page.get_by_role("button", name="Edit").click()
            box = page.get_by_test_id("stTextArea").filter(
                has_text="Edit your last message").locator("textarea")
            expect(box).to_have_value("Write a very long story")
            box.fill("A short poem instead")
            page.get_by_role("button", name="Send", exact=True).click()
            expect(messages.nth(0)).to_contain_text("A short poem instead")
            _wait_idle(page)
            expect(messages.nth(1)).to_contain_text("tokens/s")
            expect(messages).to_have_count(2)
            reply = _markdown_text(messages.nth(1)).strip()

            with page.expect_download() as info:
                sidebar.get_by_role("button", name="Download chat (JSON)").click()
            doc = json.loads(Path(info.value.path()).read_text())
            assert [m["content"] for m in doc["messages"]][0] == "A short poem instead"
            assert " ".join(doc["messages"][1]["content"].split()) == " ".join(reply.split())
            assert doc["settings"]["max_new_tokens"] == 128
            assert doc["replies"][0]["metrics"]["tokens"] > 0
            with page.expect_download() as info:
                sidebar.get_by_role("button", name="Download chat (Markdown)").click()
            assert "A short poem instead" in Path(info.value.path()).read_text()
            page.screenshot(path=str(ARTIFACTS / "app-edited.png"), full_page=True)
        finally:
            browser.close()


def test_on_screen_latency_benchmark_smoke(app_server):
    """``make bench-ui`` in miniature (CI): turn 1 and 3 of a chat, one short reply each. Checks
    that every figure is measured; the figures themselves are for docs/app.md, not asserted."""
    from qwen_trt.bench.ui_latency import run

    result = run(None, [1, 3], 128, 1, timeout_ms=STEP_TIMEOUT_MS * 3,
                 server=app_server)
    assert set(result["summary"]) == {"1", "3"}
    for turn in result["summary"].values():
        assert turn["first_char_ms"] > 0 and turn["engine_ttft_ms"] >= 0
        assert turn["visible_chars_s"] > 0 and turn["engine_chars_s"] > 0
        assert 0 <= turn["cpu_busy_pct"] <= 100
    assert set(result["targets"]) == {"first_char_within_ttft_plus_150ms",
                                      "visible_cps_at_least_90pct",
                                      "last_turn_first_char_within_1.5x_turn_1"}
