"""Start and stop real ``qwen-trt serve`` processes (and nginx) on loopback for tests.

Every wait is a bounded loop; processes are stopped by their own PID."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, sig=signal.SIGTERM, timeout: float = 15) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float = 90,
                 what: str = "server", log: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} not healthy after {timeout} s")


def start_serve(model_dir, tmp: Path, *args: str, port: int | None = None,
                env: dict | None = None) -> Served:
    port = port or free_port()
    log = tmp / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "qwen_trt.cli", "serve", "--model", str(model_dir),
           "--device", "cpu", "--port", str(port), "--log-level", "warning", *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **(env or {})}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    served = Served(proc, port, log)
    try:
        wait_healthy(served.url, proc, what=f"qwen-trt serve on {port}", log="")
    except RuntimeError as e:
        served.stop()
        raise RuntimeError(f"{e}\n{served.log_tail()}") from None
    return served
