"""Open WebUI with its default settings against ``qwen-trt serve``, in headless Chromium.

    python scripts/check_webui.py --webui .venv-clients-webui/bin/open-webui \
        --serve .venv/bin/qwen-trt --out build/out/check-clients

Writes a tiny model with a 32k context (Open WebUI sends its built-in tools with every chat:
some 25 KB of JSON, ~20k tokens with the tiny tokenizer), starts the server and Open WebUI
(OFFLINE_MODE=True, WEBUI_AUTH=False, its own data folder) on loopback, opens the page, checks
the model is listed, sends a message and waits for the streamed reply; stops both by PID.
Exit 0 when a reply appeared and the prompt counter shows the tools went into the prompt.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited early (code {proc.returncode}); see its log")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{what} not up after {timeout_s:.0f} s")


def prompt_tokens(serve_url: str) -> float:
    import httpx

    text = httpx.get(f"{serve_url}/metrics", timeout=10).text
    m = re.search(r"^qwen_trt_prompt_tokens_total ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def chat_in_browser(url: str, out: Path) -> tuple[list[str], str]:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium,
                                     args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url, timeout=120_000)
            page.wait_for_selector("#chat-input", timeout=120_000)
            page.keyboard.press("Escape")              # the release notes, on a first visit
            models = page.evaluate("""async () => {
                const r = await fetch('/api/models', {headers: {Authorization:
                  'Bearer ' + (localStorage.token || '')}});
                return (await r.json()).data.map(m => m.id); }""")
            # Random weights may end a reply at once (nothing to show): up to three messages,
            # each given 150 s, until a reply shows text.
            def replies() -> str:
                return "".join(page.locator("#response-content-container").all_inner_texts())

            reply = ""
            for attempt in range(3):
                page.click("#chat-input")
                page.keyboard.type(f"Hello there ({attempt + 1})")
                page.keyboard.press("Enter")
                deadline = time.monotonic() + 150
                while time.monotonic() < deadline and not replies().strip():
                    page.wait_for_timeout(1000)
                if replies().strip():
                    page.wait_for_timeout(3000)
                    reply = replies()
                    break
            page.screenshot(path=str(out / "webui-chat.png"))
            return models, reply
        finally:
            browser.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--webui", required=True, help="the open-webui binary (its own venv)")
    ap.add_argument("--serve", default=str(ROOT / ".venv" / "bin" / "qwen-trt"))
    ap.add_argument("--out", default=str(ROOT / "build" / "out" / "check-clients"))
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-32k"
    if not (model / "config.json").exists():
        from qwen_trt.model.tiny import TinyShape, write_tiny_model

        write_tiny_model(model, TinyShape(max_position_embeddings=32768), force=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    sport, wport = free_port(), free_port()
    serve_url, webui_url = f"http://127.0.0.1:{sport}", f"http://127.0.0.1:{wport}"
    procs = []
    try:
        with open(out / "serve.log", "wb") as log:
            procs.append(subprocess.Popen(
                [args.serve, "serve", "--model", str(model), "--device", "cpu", "--port",
                 str(sport), "--served-model-name", "tiny", "--max-seq-len", "32768",
                 "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, env=env))
        wait_http(f"{serve_url}/health", procs[0], 300, "qwen-trt serve")
        # A fresh data folder each run: Open WebUI keeps its first OPENAI_API_BASE_URL in it.
        data = out / "webui-data"
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir()
        webui_env = {**env, "OFFLINE_MODE": "True", "WEBUI_AUTH": "False",
                     "ENABLE_OLLAMA_API": "False", "OPENAI_API_BASE_URL": f"{serve_url}/v1",
                     "OPENAI_API_KEY": "none", "DATA_DIR": str(data),
                     "ANONYMIZED_TELEMETRY": "False", "SCARF_NO_ANALYTICS": "true",
                     "DO_NOT_TRACK": "true", "ENABLE_VERSION_UPDATE_CHECK": "False"}
        with open(out / "webui.log", "wb") as log:
            procs.append(subprocess.Popen(
                [str(Path(args.webui).resolve()), "serve", "--host", "127.0.0.1", "--port",
                 str(wport)],
                stdout=log, stderr=subprocess.STDOUT, env=webui_env, cwd=out))
        wait_http(f"{webui_url}/health", procs[1], 300, "Open WebUI")
        before = prompt_tokens(serve_url)
        models, reply = chat_in_browser(webui_url, out)
        used = prompt_tokens(serve_url) - before
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
    result = {"models": models, "reply": reply[:200], "prompt_tokens": used,
              "ok": "tiny" in models and bool(reply.strip()) and "context length" not in reply
              and used > 10_000}
    (out / "webui.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    print(json.dumps(result, ensure_ascii=False))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
