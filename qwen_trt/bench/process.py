"""Child servers of the benchmarks (and the tests): waiting for their readiness signal."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def _healthy_within(url: str, alive, deadline: float, interval: float = 0.2) -> bool:
    """Poll ``url``/health until it answers 200 (True), ``alive()`` turns false or the
    monotonic ``deadline`` passes (False)."""
    import httpx

    while time.monotonic() < deadline:
        if not alive():
            return False
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    return False


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float = 90,
                 what: str = "server", log_path: Path | None = None) -> None:
    """Until ``url``/health answers 200; RuntimeError (with the log's tail, when given) if
    ``proc`` exits first or ``timeout`` seconds pass."""
    alive = (lambda: proc.poll() is None) if proc is not None else (lambda: True)
    if _healthy_within(url, alive, time.monotonic() + timeout):
        return
    if proc is not None and proc.poll() is not None:
        tail = (": " + log_path.read_text(errors="replace")[-1500:]) if log_path else ""
        raise RuntimeError(f"{what} exited with {proc.returncode}{tail}")
    raise RuntimeError(f"{what} not healthy after {timeout:.0f} s")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def main(argv=None) -> int:
    """``python -m qwen_trt.bench.process URL --pid PID --timeout S [--since EPOCH] [--out F]``:
    the device scripts' wait for a server they started in the background; prints (and writes
    as ``{"healthy_s": ...}``) the seconds since ``--since`` (default: now) until healthy, or
    null if the server exited or the bound passed. Exit 0 when healthy, else 1."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.process")
    p.add_argument("url")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--since", type=float, default=None, help="epoch seconds the start began")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    since = time.time() if a.since is None else a.since
    left = a.timeout - (time.time() - since)
    ok = _healthy_within(a.url, lambda: _pid_alive(a.pid), time.monotonic() + max(0.0, left))
    healthy = round(time.time() - since, 2) if ok else None
    if a.out:
        Path(a.out).write_text(json.dumps({"healthy_s": healthy}))
    print(f"healthy after {healthy} s")
    return 0 if ok else 1


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Ask a child server to stop (SIGTERM), kill it after ``grace_s`` seconds; reaped."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


if __name__ == "__main__":
    raise SystemExit(main())
