"""What ``qwen-trt serve``'s front door costs per request and per token, on CPU, against the
engine alone, in one run.

    python -m qwen_trt.bench.front_door [--model DIR] [--requests 40] [--words 400]
        [--tokens 64] [--step-us 2500] [--out x.json]

The engine is a paced fake (:class:`PacedRunner`: every step waits ``--step-us`` and gives each
request its next token; the prefill is one step), so what is timed is everything around it: the
JSON body, the chat template and the tokenizer (``--model``: any folder with a tokenizer; a
checkpoint from ``qwen_trt.bench.shaped_model --vocab-gguf`` has Qwen's real BPE), the hand-off
to the engine process and back, detokenizing, the event loop and the SSE bytes. Three paths, one
request at a time, the same prompts:

* ``in_process``: the runner driven directly in this process (token ids in, as ``qwen-trt
  bench`` measures the engine): time to the first token and per token;
* ``engine_client``: the same runner in an engine process behind
  :class:`~qwen_trt.serving.client.WorkerClient` (pipe, pickling, detokenizing), ids in;
* ``http``: ``qwen-trt serve``'s app (uvicorn, the same WorkerClient) in a child process,
  messages in, streamed chat over loopback read by a lean socket client.

Reported: TTFT and ITL p50 per path, and the difference to ``in_process`` (the front door's
wall-clock cost per request and per token on this machine); the CPU the server process (API) and
its engine process spend, per request and per token (two workloads, ``2`` and ``--tokens`` new
tokens, solved for both; the engine's CPU excludes the paced step itself: its own loop, the
pipe, pickling); and the server's hop timings (:mod:`qwen_trt.api.hops`). CPU figures are the
robust ones on a shared machine; wall-clock moves with the load (``load_avg``). JSON out.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qwen_trt.backends.runner import RunnerStats, TokenEvent
from qwen_trt.bench.ipc import FastRunner
from qwen_trt.bench.measure import percentile
from qwen_trt.bench.process import stop

STEP_ENV = "FRONT_DOOR_STEP_US"       # the paced runner's step, for the engine process
SPIN_S = 200e-6                       # the last part of a step is spun (sleep overshoots)


class PacedRunner(FastRunner):
    """:class:`~qwen_trt.bench.ipc.FastRunner` whose every step takes ``step_us`` slept, then
    spun for the last 200 us (sleep overshoots), and whose ``step_cpu_s`` is the CPU its steps
    took (so the engine process's own overhead can be told apart)."""

    def __init__(self, step_us: float, max_concurrency: int = 8) -> None:
        super().__init__(max_concurrency, step_us)
        self.steps = 0
        self.step_cpu_s = 0.0

    def _pace(self) -> None:
        end = time.perf_counter() + self.step_s
        if self.step_s > SPIN_S:
            time.sleep(self.step_s - SPIN_S)
        while time.perf_counter() < end:
            pass

    def step(self) -> list[TokenEvent]:
        c = time.thread_time()
        events = super().step()
        self.steps += 1
        self.step_cpu_s += time.thread_time() - c
        return events

    def stats(self) -> RunnerStats:
        return RunnerStats(running=len(self.reqs),
                           extra={"paced_steps": self.steps,
                                  "paced_step_cpu_s": round(self.step_cpu_s, 6)})


def paced_runner(backend):
    return PacedRunner(float(os.environ.get(STEP_ENV, "2500")))


def _spec(model: str):
    from qwen_trt.backends import BackendConfig
    from qwen_trt.serving.worker import WorkerSpec

    return WorkerSpec(BackendConfig(model=model), loader="qwen_trt.bench.ipc:load_fake",
                      runner="qwen_trt.bench.front_door:paced_runner")


def prompt(i: int, words: int) -> str:
    """A distinct prompt per request (no prefix or text cache helps)."""
    return f"Request {i}. " + " ".join(f"word{(i * 7 + k) % 997}" for k in range(words))


def _cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``'s threads now (Linux: the scheduler's nanosecond run time per
    thread, /proc/PID/task/*/schedstat; the 10 ms ticks of /proc/PID/stat are too coarse)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass                    # the thread ended meanwhile
    return total / 1e9


# -- the three paths -------------------------------------------------------------------------
def run_in_process(step_us: float, n: int, tokens: int) -> dict:
    from qwen_trt.params import SamplingParams

    runner = PacedRunner(step_us)
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    ttft, itl = [], []
    for i in range(n):
        t0 = time.perf_counter()
        runner.add(i, [1, 2, 3], params)
        last, got = None, 0
        while runner.has_work():
            for ev in runner.step():
                now = time.perf_counter()
                got += len(ev.token_ids)
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now
        assert got == tokens
    return _summary(ttft, itl, n, tokens)


def run_engine_client(model: str, prompts: list[list[int]], tokens: int) -> dict:
    from qwen_trt.params import SamplingParams
    from qwen_trt.serving.client import WorkerClient
    from qwen_trt.serving.events import Delta, Finished

    client = WorkerClient(_spec(model), echo=io.StringIO())
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    ttft, itl = [], []
    try:
        for ids in prompts:
            t0 = time.perf_counter()
            last, got = None, 0
            for ev in client.submit(ids, params).events(poll_s=1.0):
                if isinstance(ev, Delta) and ev.text:
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - t0)
                    else:
                        itl.append(now - last)
                    last = now
                    got += len(ev.token_ids)
                elif isinstance(ev, Finished):
                    got = ev.reply.metrics.tokens
                    break
            if got != tokens:
                raise RuntimeError(f"worker client: {got} tokens, expected {tokens}")
    finally:
        client.close()
    return _summary(ttft, itl, len(prompts), tokens)


class _Http:
    """A lean HTTP/1.1 keep-alive client for one streamed chat at a time (chunked SSE)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def request(self, method: str, path: str, body: bytes = b"") -> None:
        head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        self.sock.sendall(head + body)

    def _more(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._more()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self):
        """(status, headers); then :meth:`chunks` or :meth:`body`."""
        status = int(self._line().split()[1])
        headers = {}
        while line := self._line():
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        return status, headers

    def body(self, headers) -> bytes:
        if headers.get("transfer-encoding") == "chunked":
            return b"".join(self.chunks())
        return self._exact(int(headers.get("content-length", 0)))

    def chunks(self):
        """Each chunk of a chunked body as it arrives."""
        while True:
            size = int(self._line().split(b";")[0], 16)
            if size == 0:
                self._line()
                return
            data = self._exact(size)
            self._exact(2)
            yield data

    def get_json(self, path: str):
        self.request("GET", path)
        status, headers = self.response()
        return status, self.body(headers)

    def close(self) -> None:
        self.sock.close()


def _chat_body(i: int, words: int, tokens: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": prompt(i, words)}],
                       "stream": True, "stream_options": {"include_usage": True},
                       "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True}).encode()


def http_requests(client: _Http, first: int, n: int, words: int, tokens: int) -> dict:
    ttft, itl = [], []
    for i in range(first, first + n):
        t0 = time.perf_counter()
        client.request("POST", "/v1/chat/completions", _chat_body(i, words, tokens))
        status, headers = client.response()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {client.body(headers)[:200]!r}")
        last, got, done = None, 0, False
        for data in client.chunks():
            for event in data.split(b"\n\n"):
                if not event.startswith(b"data: "):
                    continue
                if event == b"data: [DONE]":
                    done = True
                    continue
                obj = json.loads(event[6:])
                for ch in obj.get("choices") or ():
                    if (ch.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if last is None:
                            ttft.append(now - t0)
                        else:
                            itl.append(now - last)
                        last = now
                if obj.get("usage"):
                    got = obj["usage"]["completion_tokens"]
        if not done or got != tokens:
            raise RuntimeError(f"HTTP request {i}: {got} tokens, [DONE] {done}")
    return _summary(ttft, itl, n, tokens)


def _summary(ttft: list[float], itl: list[float], n: int, tokens: int) -> dict:
    return {"requests": n, "tokens": tokens,
            "ttft_ms_p50": round(percentile([x * 1e3 for x in ttft], 50), 4),
            "ttft_ms_p90": round(percentile([x * 1e3 for x in ttft], 90), 4),
            "itl_ms_p50": round(percentile([x * 1e3 for x in itl], 50), 4) if itl else None,
            "itl_ms_mean": round(sum(itl) / len(itl) * 1e3, 4) if itl else None}


# -- the server child ------------------------------------------------------------------------
def serve_child(model: str, port: int) -> None:
    """``qwen-trt serve``'s app on the paced engine (run in a child process); prints the engine
    process's pid once listening."""
    import uvicorn

    from qwen_trt.api.server import ServerSettings, create_app
    from qwen_trt.api.shutdown import uvicorn_config
    from qwen_trt.serving.client import WorkerClient

    service = WorkerClient(_spec(model), echo=io.StringIO())
    settings = ServerSettings(port=port)
    app = create_app(service, settings, model_name="m")
    print(json.dumps({"engine_pid": service.pid}), flush=True)
    try:
        uvicorn.Server(uvicorn_config(app, settings, log_level="warning")).run()
    finally:
        service.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_http(model: str, step_us: float, n: int, warmup: int, words: int,
             tokens: int, timeout_s: float = 120.0) -> dict:
    port = _free_port()
    env = dict(os.environ, **{STEP_ENV: str(step_us), "QWEN_TRT_TRACE_HOPS": "1"},
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, "-m", "qwen_trt.bench.front_door", "--serve-child",
                             str(port), "--model", model], stdout=subprocess.PIPE, env=env,
                            text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the server child exited before it listened")
        engine_pid = json.loads(line)["engine_pid"]
        deadline = time.monotonic() + timeout_s
        client = None
        while client is None:
            try:
                client = _Http(port)
                if client.get_json("/health")[0] != 200:
                    raise OSError("not healthy yet")
            except OSError:
                if client is not None:
                    client.close()
                client = None
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the server child did not become healthy") from None
                time.sleep(0.05)
        http_requests(client, 10_000, warmup, words, tokens)      # first-use work, not timed
        out = {}
        # Two workloads: few tokens, then many; CPU = requests * a + tokens * b for each.
        for key, k in (("short", 2), ("long", tokens)):
            api0, eng0 = _cpu_s(proc.pid), _cpu_s(engine_pid)
            _, raw = client.get_json("/debug/hops")
            paced0 = json.loads(raw)["runner"]["extra"].get("paced_step_cpu_s", 0.0)
            out[key] = http_requests(client, 0 if key == "long" else 20_000, n, words, k)
            time.sleep(0.3)         # the engine's stats reach the API at most 4x a second
            api1, eng1 = _cpu_s(proc.pid), _cpu_s(engine_pid)
            _, raw = client.get_json("/debug/hops")
            hops = json.loads(raw)
            paced1 = hops["runner"]["extra"].get("paced_step_cpu_s", 0.0)
            out[key]["api_cpu_s"] = round(api1 - api0, 4)
            out[key]["engine_loop_cpu_s"] = round(max(0.0, (eng1 - eng0) - (paced1 - paced0)), 4)
        out["hops_us"] = {k: v for k, v in hops.items() if k != "runner"}
        client.close()
        return out
    finally:
        stop(proc)


def _per_unit(short: dict, long: dict, key: str) -> tuple[float, float]:
    """Solve ``cpu = n * (per_request + tokens * per_token)`` from the two workloads (us)."""
    n = short["requests"]
    per_token = (long[key] - short[key]) / (n * (long["tokens"] - short["tokens"]))
    per_request = short[key] / n - short["tokens"] * per_token
    return round(per_request * 1e6, 1), round(per_token * 1e6, 2)


def measure(model: str, *, requests: int = 40, warmup: int = 3, words: int = 400,
            tokens: int = 64, step_us: float = 2500.0) -> dict:
    from transformers import AutoTokenizer

    from qwen_trt.api.prompt import encode_messages

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [encode_messages(tok, [{"role": "user", "content": prompt(i, words)}])
               for i in range(requests)]
    res = {"tool": "qwen_trt.bench.front_door", "host": platform.node(),
           "cpus": os.cpu_count(), "python": sys.version.split()[0],
           "load_avg": round(os.getloadavg()[0], 2), "model": model,
           "prompt_tokens": len(prompts[0]), "step_us": step_us, "words": words}
    res["in_process"] = run_in_process(step_us, requests, tokens)
    res["engine_client"] = run_engine_client(model, prompts, tokens)
    http = run_http(model, step_us, requests, warmup, words, tokens)
    res["http"] = http.pop("long")
    res["http_short"] = http.pop("short")
    res["hops_us"] = http["hops_us"]
    base = res["in_process"]
    for key in ("engine_client", "http"):
        res[f"{key}_over_in_process"] = {
            "ttft_ms": round(res[key]["ttft_ms_p50"] - base["ttft_ms_p50"], 4),
            "itl_ms_mean": round(res[key]["itl_ms_mean"] - base["itl_ms_mean"], 4)}
    api_req, api_tok = _per_unit(res["http_short"], res["http"], "api_cpu_s")
    eng_req, eng_tok = _per_unit(res["http_short"], res["http"], "engine_loop_cpu_s")
    res["cpu_us"] = {"api_per_request": api_req, "api_per_token": api_tok,
                     "engine_loop_per_request": eng_req, "engine_loop_per_token": eng_tok}
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen_trt.bench.front_door",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a folder with a tokenizer (default: the "
                                                 "offline tiny model)")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--words", type=int, default=400, help="prompt length in words")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--step-us", type=float, default=2500.0,
                   help="the paced runner's step (2500: the H200's batch-1 decode)")
    p.add_argument("--out", default=None)
    p.add_argument("--serve-child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.requests < 1 or args.tokens < 3:
        p.error("--requests must be >= 1 and --tokens >= 3")
    model = args.model
    if model is None:
        from qwen_trt.model.tiny import write_tiny_model

        model = str(write_tiny_model(Path(tempfile.mkdtemp(prefix="front-door-"))))
    if args.serve_child is not None:
        serve_child(model, args.serve_child)
        return 0
    res = measure(model, requests=args.requests, warmup=args.warmup, words=args.words,
                  tokens=args.tokens, step_us=args.step_us)
    text = json.dumps(res, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
