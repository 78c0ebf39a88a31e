"""Start and stop real ``qwen-trt serve`` processes (and nginx) on loopback for tests.

Every wait is a bounded loop; processes are stopped by their own PID."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from qwen_trt.bench.process import wait_healthy

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

    def wait(self) -> None:
        try:
            wait_healthy(self.url, self.proc, what=f"qwen-trt serve on {self.port}")
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{e}\n{self.log_tail()}") from None

    def stop(self, sig=signal.SIGTERM, timeout: float = 15) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@contextlib.contextmanager
def app_in_thread(app, port: int | None = None, config=None) -> Iterator[str]:
    """Serve the ASGI ``app`` with uvicorn in a thread on 127.0.0.1 (``port`` or a free one);
    yields its origin ``http://127.0.0.1:PORT`` once it listens, stops it afterwards.
    ``config``: a ready ``uvicorn.Config`` to run instead (its host and port are used)."""
    import uvicorn

    if config is not None:
        port = config.port
    port = port or free_port()
    server = uvicorn.Server(config or uvicorn.Config(app, host="127.0.0.1", port=port,
                                                     log_level="warning"))
    host = config.host if config is not None else "127.0.0.1"
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if not server.started:
        server.should_exit = True
        raise RuntimeError(f"the test server on port {port} did not start")
    try:
        yield f"http://{f'[{host}]' if ':' in host else host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def start_serve(model_dir, tmp: Path, *args: str, port: int | None = None,
                env: dict | None = None, wait: bool = True) -> Served:
    port = port or free_port()
    log = tmp / f"serve-{port}.log"
    cmd = [sys.executable, "-m", "qwen_trt.cli", "serve", "--model", str(model_dir),
           "--device", "cpu", "--port", str(port), "--log-level", "warning", *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **(env or {})}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    served = Served(proc, port, log)
    if wait:
        served.wait()
    return served


NGINX_CONF = ROOT / "deploy" / "nginx.conf"


def nginx_binary() -> str | None:
    import shutil

    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


@dataclass
class Nginx:
    proc: subprocess.Popen
    port: int
    prefix: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def access_log(self) -> str:
        try:
            return (self.prefix / "logs" / "access.log").read_text()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)     # graceful: the master stops its workers
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_nginx(prefix: Path, upstream_ports: list[int], port: int | None = None, *,
                conf_text: str | None = None) -> Nginx:
    """deploy/nginx.conf itself (or ``conf_text``, a variant of it), with these ports, in the
    foreground under ``prefix``."""
    import re

    port = port or free_port()
    conf = NGINX_CONF.read_text() if conf_text is None else conf_text
    conf = conf.replace("listen 127.0.0.1:8000;", f"listen 127.0.0.1:{port};")
    servers = iter(upstream_ports)
    conf = re.sub(r"server 127\.0\.0\.1:800[12] ", lambda _m: f"server 127.0.0.1:{next(servers)} ",
                  conf)
    conf = conf.replace("worker_processes auto;", "worker_processes 1;\ndaemon off;")
    if os.geteuid() == 0:   # workers would otherwise run as nobody, locked out of a 0700 tmp dir
        conf = "user root;\n" + conf
    for d in ("logs", "tmp"):
        (prefix / d).mkdir(parents=True, exist_ok=True)
    path = prefix / "nginx.conf"
    path.write_text(conf)
    log = open(prefix / "logs" / "stderr.log", "wb")
    proc = subprocess.Popen([nginx_binary(), "-p", str(prefix), "-c", str(path), "-e",
                             str(prefix / "logs" / "error.log")], stdout=log,
                            stderr=subprocess.STDOUT)
    ng = Nginx(proc, port, prefix)
    try:
        wait_healthy(ng.url, proc, timeout=20, what="nginx")
    except RuntimeError as e:
        ng.stop()
        err = (prefix / "logs" / "error.log")
        raise RuntimeError(f"{e}: {err.read_text()[-2000:] if err.exists() else ''}") from None
    return ng


def wait_for(cond, timeout: float = 60) -> bool:
    """Whether ``cond()`` holds within ``timeout`` seconds (polled; a readiness signal with a
    generous bound, never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()
