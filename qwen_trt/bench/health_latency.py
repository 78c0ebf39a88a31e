"""``/health`` latency while one large request is handled (the server must keep answering).

    python -m qwen_trt.bench.health_latency [--model DIR] [--mb 10] [--out x.json]

Runs the API on the model (default: the offline tiny model, CPU) in a child process, then for
each scenario sends one request of ``--mb`` MB of text (chat messages, or with ``--endpoint``
a ``/v1/completions`` or ``/tokenize`` prompt) and polls ``/health`` from this process while it
is in flight. Scenarios: ``engine-context`` (the engine's own context: the
cheap length bound refuses it before tokenising) and ``wide-context`` (the service reports a
context of ``--wide-context`` tokens, so the whole text is tokenised, in worker threads, before
the 400). JSON out: per scenario the request's status and time, and /health p50 / p99 / max in
milliseconds (target: max <= 100 ms), plus the idle baseline.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from qwen_trt.bench.process import wait_healthy
from qwen_trt.bench.measure import percentile

TARGET_MS = 100.0
TEXT = "hello wörld, this is some text 123 "


class WideContext:
    """A service that reports a larger context than its engine has (requests longer than the
    engine's own are refused by the API after tokenising, never reaching the engine)."""

    def __init__(self, service, max_seq_len: int) -> None:
        self._service = service
        self.info = dataclasses.replace(service.info, max_seq_len=max_seq_len,
                                        max_input_len=max_seq_len - 1)

    def __getattr__(self, name):
        return getattr(self._service, name)


def serve_child(model: str, port: int, wide_context: int) -> None:
    """The server under test (run in a child process)."""
    from qwen_trt.api.server import ServerSettings, run_server
    from qwen_trt.backends import BackendConfig
    from qwen_trt.serving.service import start_service

    service = start_service(BackendConfig(backend="torch", model=model, device="cpu", warmup=False),
                            mode="inline")
    if wide_context:
        service = WideContext(service, wide_context)
    run_server(service, ServerSettings(port=port), log_level="warning")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_child(model: str, wide_context: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "qwen_trt.bench.health_latency", "--child", "--model", model,
           "--port", str(port), "--wide-context", str(wide_context)]
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 180)
    return proc, url


def stop_child(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def _stats(ms: list[float]) -> dict:
    return {"polls": len(ms), "p50_ms": round(percentile(ms, 50), 2),
            "p99_ms": round(percentile(ms, 99), 2), "max_ms": round(max(ms), 2)} if ms else \
        {"polls": 0}


# where the large text goes: the path, and the body around it
ENDPOINTS = {"chat": ("/v1/chat/completions",
                      lambda text: {"messages": [{"role": "user", "content": text}]}),
             "completions": ("/v1/completions", lambda text: {"prompt": text}),
             "tokenize": ("/tokenize", lambda text: {"prompt": text})}


def measure(url: str, mb: float, poll_s: float = 0.05, health_timeout_s: float = 60,
            endpoint: str = "chat") -> dict:
    """One request of ``mb`` MB of text to ``endpoint`` (a key of :data:`ENDPOINTS`); /health
    latencies while it is in flight (a /health slower than ``health_timeout_s`` raises)."""
    import httpx

    content = (TEXT * (int(mb * 1e6) // len(TEXT) + 1))[:int(mb * 1e6)]
    path, shape = ENDPOINTS[endpoint]
    body = json.dumps(shape(content)).encode()
    result: dict = {}

    def big() -> None:
        t0 = time.perf_counter()
        r = httpx.post(f"{url}{path}", content=body, timeout=600,
                       headers={"content-type": "application/json"})
        result.update(status=r.status_code, request_s=round(time.perf_counter() - t0, 3),
                      error=(r.json().get("error") or {}).get("message", "")[:160]
                      if r.status_code != 200 else "")

    lat: list[float] = []
    with httpx.Client(timeout=health_timeout_s) as client:
        t = threading.Thread(target=big)
        t.start()
        while t.is_alive():
            t0 = time.perf_counter()
            if client.get(f"{url}/health").status_code != 200:
                raise RuntimeError("/health did not say 200 during the request")
            lat.append((time.perf_counter() - t0) * 1000)
            t.join(poll_s)
    return {**result, "health_during": _stats(lat)}


def baseline(url: str, n: int = 30) -> dict:
    import httpx

    lat = []
    with httpx.Client(timeout=30) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            client.get(f"{url}/health")
            lat.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.02)
    return _stats(lat)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the tiny model)")
    p.add_argument("--mb", type=float, default=10.0, help="size of the large request's text")
    p.add_argument("--wide-context", type=int, default=5_000_000,
                   help="context the wide-context scenario reports, in tokens")
    p.add_argument("--endpoint", default="chat", choices=sorted(ENDPOINTS),
                   help="where the large text goes (chat messages, a completions or a "
                        "/tokenize prompt)")
    p.add_argument("--out", default=None, help="JSON file (default: stdout only)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        serve_child(args.model, args.port, args.wide_context)
        return 0
    with tempfile.TemporaryDirectory(prefix="qwen-trt-health-") as tmp:
        model = args.model
        if model is None:
            from qwen_trt.model.tiny import write_tiny_model

            model = str(write_tiny_model(Path(tmp) / "tiny"))
        log = Path(tmp) / "server.log"
        out: dict = {"mb": args.mb, "endpoint": args.endpoint, "target_max_ms": TARGET_MS,
                     "scenarios": {}}
        for name, wide in (("engine-context", 0), ("wide-context", args.wide_context)):
            proc, url = start_child(model, wide, log)
            try:
                out["baseline"] = out.get("baseline") or baseline(url)
                out["scenarios"][name] = measure(url, args.mb, endpoint=args.endpoint)
            finally:
                out["scenarios"].setdefault(name, {})["exit_code"] = stop_child(proc)
    worst = max(s.get("health_during", {}).get("max_ms", 0) for s in out["scenarios"].values())
    out["meets_target"] = worst <= TARGET_MS
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
