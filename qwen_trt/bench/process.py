"""Child servers of the benchmarks (and the tests): waiting for their readiness signal."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float = 90,
                 what: str = "server", log_path: Path | None = None) -> None:
    """Until ``url``/health answers 200; RuntimeError (with the log's tail, when given) if
    ``proc`` exits first or ``timeout`` seconds pass."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = (": " + log_path.read_text(errors="replace")[-1500:]) if log_path else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} not healthy after {timeout:.0f} s")


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Ask a child server to stop (SIGTERM), kill it after ``grace_s`` seconds; reaped."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
