"""The front door's hand-offs: the engine pipe's Outbox, the Inbox timer, the prompt encoder's
text cache under a token limit, the SSE writes of one stream, and the front-door bench (CPU)."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from qwen_trt.serving.ipc import Outbox, SocketConn


def _pair(sndbuf: int | None = None):
    a, b = socket.socketpair()
    if sndbuf:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    return SocketConn(a), SocketConn(b)


def test_outbox_writes_from_the_calling_thread_when_the_pipe_has_room():
    mine, theirs = _pair()
    box = Outbox(mine)
    try:
        for i in range(20):
            box.put(("submit", i))
        got = [theirs.recv() for _ in range(20)]
        assert got == [("submit", i) for i in range(20)]
        assert box.direct == 20              # no hand-off to the sender thread
    finally:
        box.close()
        theirs.close()


def test_outbox_never_blocks_and_keeps_order_when_the_pipe_is_full():
    mine, theirs = _pair(sndbuf=4096)
    box = Outbox(mine)
    blob = b"x" * 20000                      # a few messages fill the socket's buffers
    n = 200
    t = time.monotonic()
    for i in range(n):
        box.put((i, blob))
    assert time.monotonic() - t < 10         # nobody reads yet: put must not wait for that
    assert box.direct < n                    # some went to the sender thread
    got = [theirs.recv()[0] for _ in range(n)]
    assert got == list(range(n))             # the direct writes and the queued ones in order
    box.close()
    deadline = time.monotonic() + 10
    while mine.sock.fileno() != -1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mine.sock.fileno() == -1          # the sender closed the pipe after the queue
    box.put(("late",))                       # after close: dropped, no error
    theirs.close()


def test_outbox_marks_a_broken_pipe_and_drops_later_messages():
    mine, theirs = _pair()
    theirs.close()
    box = Outbox(mine)
    for _ in range(3):
        box.put(("abort", 1))               # EPIPE on the first: no exception to the caller
    assert box.broken
    box.close()


def test_inbox_arms_one_timer_per_wait_period_not_per_take():
    from qwen_trt.serving.async_events import Inbox

    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_at

        def counting(when, cb, *args, **kw):
            calls.append(when)
            return real(when, cb, *args, **kw)
        loop.call_at = counting            # type: ignore[method-assign]
        inbox = Inbox()
        for i in range(50):                # an event arrives while each take waits
            loop.call_soon(inbox._push, i, 0.0)
            assert await inbox.take(5.0) == [i]
        t = loop.time()
        assert await inbox.take(0.05) == []           # the timeout still ends a wait
        assert loop.time() - t >= 0.04

    asyncio.run(main())
    assert len(calls) <= 3, calls          # before: one call_later per take (51)


def test_prompt_encoder_caches_text_under_a_token_limit(tiny_tokenizer, monkeypatch):
    from qwen_trt.api.encoder import PromptEncoder
    from qwen_trt.api.prompt import encode_messages

    enc = PromptEncoder(tiny_tokenizer)
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello there, a longer first question"}]
    ids = enc.encode(msgs, limit=4000)
    assert ids == encode_messages(tiny_tokenizer, msgs)
    codec = enc._encoder._codec
    seen: list[str] = []
    real = codec.ids_within
    monkeypatch.setattr(codec, "ids_within", lambda text, room: seen.append(text) or
                        real(text, room))
    turn2 = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "new"}]
    ids2 = enc.encode(turn2, limit=4000)
    assert ids2 == encode_messages(tiny_tokenizer, turn2)
    assert "be brief" not in seen and not any("first question" in t for t in seen), seen
    assert enc.encode(msgs, limit=4000) == ids              # cached again, same ids
    with pytest.raises(Exception, match="tokens"):           # the limit still holds
        enc.encode(msgs, limit=3)


def test_text_cache_is_bounded_by_its_total_ids():
    from qwen_trt.api.encoder import _LRU

    lru = _LRU(100, max_weight=10)
    lru.put("a", (1,) * 6)
    lru.put("b", (2,) * 3)
    lru.put("c", (3,) * 4)                 # 13 > 10: the oldest goes
    assert lru.get("a") is None and lru.get("b") and lru.get("c")
    lru.put("huge", (0,) * 11)             # larger than the bound: never kept
    assert lru.get("huge") is None and lru.get("c")


def test_a_stream_ends_with_one_write_and_releases_on_the_loop(tiny_tokenizer):
    """The last content chunk's finish, the usage and [DONE] leave in one body message, and
    the response's clean-up runs on the event loop's thread (no worker-thread hop)."""
    from fakes import ScriptedBackend

    from qwen_trt.api.admission import Ticket
    from qwen_trt.api.server import ServerSettings, create_app
    from qwen_trt.serving.service import InferenceService

    service = InferenceService(ScriptedBackend(tiny_tokenizer, "hello world"))
    app = create_app(service, ServerSettings(), model_name="fake")
    released_on: list[str] = []
    real_release = Ticket.release

    def release(self, *a, **kw):
        released_on.append(threading.current_thread().name)
        return real_release(self, *a, **kw)

    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    sent: list[dict] = []

    async def main():
        threading.current_thread().name = "the-loop"
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())],
                 "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80),
                 "client": ("127.0.0.1", 1), "state": {}}
        done = asyncio.Event()
        given = [False]

        async def receive():
            if not given[0]:
                given[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            sent.append(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                done.set()
        await asyncio.wait_for(app(scope, receive, send), 60)

    name = threading.current_thread().name
    Ticket.release = release
    try:
        asyncio.run(main())
    finally:
        Ticket.release = real_release
        threading.current_thread().name = name
        service.close()
    bodies = [m["body"].decode() for m in sent if m["type"] == "http.response.body" and m["body"]]
    last = bodies[-1]
    assert last.endswith("data: [DONE]\n\n")
    events = [e for e in last.split("\n\n") if e.startswith("data: {")]
    assert any('"finish_reason":"stop"' in e for e in events), last      # the finish chunk
    assert any('"usage"' in e and '"choices":[]' in e for e in events), last   # the usage
    assert released_on and set(released_on) == {"the-loop"}, released_on


def test_front_door_bench_smoke(tmp_path):
    """The bench's three paths on the tiny model (shape, not speed)."""
    from qwen_trt.bench.front_door import main

    out = tmp_path / "fd.json"
    assert main(["--requests", "3", "--warmup", "1", "--words", "8", "--tokens", "4",
                 "--step-us", "500", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in ("in_process", "engine_client", "http", "http_short"):
        assert res[key]["requests"] == 3 and res[key]["ttft_ms_p50"] > 0, key
    assert res["in_process"]["ttft_ms_p50"] >= 0.45          # one paced step
    assert res["http"]["tokens"] == 4 and res["http_short"]["tokens"] == 2
    assert res["http"]["api_cpu_s"] > 0
    assert set(res["cpu_us"]) == {"api_per_request", "api_per_token", "engine_loop_per_request",
                                  "engine_loop_per_token"}
    assert res["hops_us"]["requests"] >= 6 and res["hops_us"]["encode"]["n"] >= 6


def test_an_attached_event_loop_reads_the_engine_pipe(tiny_model_dir, tiny_tokenizer):
    """After attach_loop the worker's messages are read on that loop (no reader-thread hop);
    a killed worker restarts and is read there again once ready; a closed or stopped loop
    hands the pipe back to the reader thread."""
    import io
    import os
    import signal

    from qwen_trt.backends import BackendConfig
    from qwen_trt.params import SamplingParams
    from qwen_trt.serving.client import WorkerClient
    from qwen_trt.serving.worker import WorkerSpec

    client = WorkerClient(WorkerSpec(BackendConfig(model=str(tiny_model_dir)),
                                     loader="serving_fakes:load_echo",
                                     runner="serving_fakes:RoundRobinRunner"), echo=io.StringIO())
    read_on: list[str] = []
    real = client._on_events

    def on_events(gen, events, stats):
        read_on.append(threading.current_thread().name)
        return real(gen, events, stats)
    client._on_events = on_events               # type: ignore[method-assign]
    ids = tiny_tokenizer.encode("hello there", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    want = client.submit(ids, params).result(60).text

    def start_loop(name: str):
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True, name=name).start()

        async def attach():
            client.attach_loop(asyncio.get_running_loop())
        asyncio.run_coroutine_threadsafe(attach(), loop).result(10)
        return loop

    def read_by(name: str, tries: int = 100) -> None:
        for _ in range(tries):                  # the hand-over is asynchronous: a few requests
            read_on.clear()
            assert client.submit(ids, params).result(60).text == want
            if read_on and set(read_on) == {name}:
                return
        raise AssertionError(f"never read on {name}: {read_on}")

    def stop(loop) -> None:
        loop.call_soon_threadsafe(loop.stop)
        deadline = time.monotonic() + 10
        while loop.is_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        loop.close()

    try:
        assert read_on and "the-loop" not in read_on            # the reader thread so far
        loop = start_loop("the-loop")
        read_by("the-loop")
        for _ in range(5):                                       # and it stays there
            read_on.clear()
            assert client.submit(ids, params).result(60).text == want
            assert set(read_on) == {"the-loop"}, read_on
        os.kill(client.pid, signal.SIGKILL)                      # dies while read on the loop
        deadline = time.monotonic() + 60
        while client.status().state == "ready" and time.monotonic() < deadline:
            time.sleep(0.01)
        read_by("the-loop")                                      # restarted, on the loop again
        assert client.status().restarts == 1
        stop(loop)
        read_by("qwen-trt-worker-reader")                        # the thread took over
        loop2 = start_loop("loop-2")
        read_by("loop-2")
        loop2.call_soon_threadsafe(loop2.stop)                   # stopped, never closed
        read_by("qwen-trt-worker-reader")
        loop2.close()
    finally:
        client.close()
