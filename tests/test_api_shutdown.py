"""SIGTERM / SIGINT on a real ``qwen-trt serve`` (tiny model, the engine in its own process):
no new connections, in-flight requests get the grace period, the rest end in OpenAI's shape
(a stream: an error event then ``data: [DONE]``; a whole reply: a JSON 503), the engine
process is closed and the server exits 0."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from servers import start_serve, wait_for


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                status = (d / "status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{pid}\n" in status:
                out.append(int(d.name))
    return out


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("\nState:\t", 1)[1][0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("qwen_trt_requests_waiting ", "qwen_trt_requests_running ")):
            total += float(line.split()[1])
    return total


def long_body(stream: bool, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": "Tell me a long story"}], "stream": stream,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


class Stream(threading.Thread):
    """A streaming request read line by line in the background."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[str] = []
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=self.body,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.error = e

    def contents(self) -> int:
        return sum(1 for e in self.events if '"content":"' in e and '"content":""' not in e)


@pytest.fixture
def engine_env():
    return {"QWEN_TRT_WORKER": "process", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_what_outlasts_the_grace_in_openai_shape_and_exits_0(
        tiny_model_dir, tmp_path, engine_env, sig):
    served = start_serve(tiny_model_dir, tmp_path, "--shutdown-grace-s", "1",
                         "--max-seq-len", "4096", env=engine_env)
    try:
        workers = children(served.proc.pid)
        stream = Stream(served.url, long_body(True, 4000))
        stream.start()
        assert wait_for(lambda: stream.contents() >= 2), served.log_tail()
        whole: dict = {}
        t = threading.Thread(target=lambda: whole.update(r=httpx.post(
            f"{served.url}/v1/chat/completions", json=long_body(False, 4000), timeout=120)),
            daemon=True)
        t.start()
        assert wait_for(lambda: in_flight(served.url) >= 2), served.log_tail()
        served.proc.send_signal(sig)
        # no new connections once it is shutting down
        assert wait_for(lambda: _refused(served.url), 30), served.log_tail()
        stream.join(60)
        t.join(60)
        assert stream.error is None, stream.error
        assert stream.events[-1] == "[DONE]"
        err = json.loads(stream.events[-2])["error"]
        assert err["type"] == "service_unavailable" and "shutting down" in err["message"]
        r = whole["r"]
        assert r.status_code == 503 and r.headers["content-type"].startswith("application/json")
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert served.proc.wait(60) == 0, served.log_tail()
        assert workers and wait_for(lambda: all(gone(p) for p in workers), 30)
        assert "Traceback" not in served.log.read_text(errors="replace"), served.log_tail(40)
    finally:
        served.stop()


def test_a_request_that_finishes_within_the_grace_is_served_whole(tiny_model_dir, tmp_path,
                                                                  engine_env):
    served = start_serve(tiny_model_dir, tmp_path, "--shutdown-grace-s", "60", env=engine_env)
    try:
        stream = Stream(served.url, long_body(True, 64))
        stream.start()
        assert wait_for(lambda: stream.contents() >= 1), served.log_tail()
        os.kill(served.proc.pid, signal.SIGTERM)
        stream.join(90)
        assert stream.error is None and stream.events[-1] == "[DONE]"
        assert not any('"error"' in e for e in stream.events)
        finals = [json.loads(e)["choices"][0]["finish_reason"] for e in stream.events[:-1]
                  if json.loads(e).get("choices")]
        assert finals[-1] == "length"
        assert served.proc.wait(90) == 0, served.log_tail()
    finally:
        served.stop()


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False
