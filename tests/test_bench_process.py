"""qwen_trt.bench.process: the device scripts' wait for a background server (CPU)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from qwen_trt.bench.process import main, stop

HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_waits_for_health_and_says_when(tmp_path):
    port = _port()
    since = time.time()
    proc = subprocess.Popen([sys.executable, "-c", HEALTH_SERVER, str(port)])
    try:
        out = tmp_path / "h.json"
        assert main([f"http://127.0.0.1:{port}", "--pid", str(proc.pid), "--timeout", "60",
                     "--since", str(since), "--out", str(out)]) == 0
        healthy = json.loads(out.read_text())["healthy_s"]
        # rounded to 10 ms by the tool
        assert healthy is not None and 0 <= healthy <= time.time() - since + 0.01
    finally:
        stop(proc)
    assert proc.returncode is not None


def test_a_server_that_exits_first_is_null_not_a_hang(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    out = tmp_path / "h.json"
    t = time.monotonic()
    assert main([f"http://127.0.0.1:{_port()}", "--pid", str(proc.pid), "--timeout", "60",
                 "--out", str(out)]) == 1
    assert json.loads(out.read_text()) == {"healthy_s": None}
    assert time.monotonic() - t < 30          # it noticed the exit, not the bound
