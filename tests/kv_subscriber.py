"""A ZMQ subscriber of KV-cache events in vLLM's format, as llm-d's KV indexer reads them (tests
of qwen_trt/serving/kv_events.py: tests/test_kv_events.py, tests/test_gateway.py)."""
from __future__ import annotations

import threading
import time

import msgpack
import zmq

from qwen_trt.serving.kv_events import block_hash
from servers import free_port


class Subscriber:
    """A SUB socket that binds (llm-d's layout: the engines connect to the indexer), read by its
    own thread all along, as an indexer reads (a SUB socket that nobody polls does not pass its
    subscription on to a publisher that connects, which then drops everything)."""

    def __init__(self, prefix: str) -> None:
        self.port = free_port()
        self.prefix = prefix                # topics starting with it
        self.batches: list[tuple[str, int, float, list]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self.prefix.encode())
        sock.bind(self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(50):
                    continue
                topic, seq, payload = sock.recv_multipart()
                assert len(seq) == 8
                ts, events = msgpack.unpackb(payload)     # EventBatch, array layout
                with self._lock:
                    self.batches.append((topic.decode(), int.from_bytes(seq, "big"), ts,
                                         events))
        finally:
            sock.close(0)
            ctx.term()

    def wait(self, until, timeout: float = 30) -> list:
        """The events so far, once ``until(events)`` holds (or after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until(self.events()):
            time.sleep(0.02)
        return self.events()

    def quiet(self, for_s: float = 0.5, timeout: float = 30) -> list:
        """The events so far, once none has arrived for ``for_s`` seconds."""
        deadline = time.monotonic() + timeout
        n, since = len(self.batches), time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - since < for_s:
            time.sleep(0.05)
            if len(self.batches) != n:
                n, since = len(self.batches), time.monotonic()
        return self.events()

    def events(self, topic: str | None = None) -> list:
        with self._lock:
            return [ev for t, _, _, evs in self.batches if topic in (None, t) for ev in evs]

    def clear(self) -> None:
        with self._lock:
            self.batches.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def stored_blocks(events) -> dict[int, tuple[int | None, list[int]]]:
    """hash -> (parent hash, its tokens), from the BlockStored events (checking each chain)."""
    out = {}
    for ev in events:
        if ev[0] != "BlockStored":
            continue
        tag, hashes, parent, tokens, size, lora_id, medium, lora_name = ev
        assert (lora_id, medium, lora_name) == (None, "GPU", None)
        assert len(tokens) == size * len(hashes)
        for i, h in enumerate(hashes):
            chunk = tokens[i * size:(i + 1) * size]
            assert h == block_hash(parent, chunk)      # the chain: each block names its parent
            out[h] = (parent, chunk)
            parent = h
    return out


def removed_blocks(events) -> list[int]:
    out = []
    for ev in events:
        if ev[0] == "BlockRemoved":
            tag, hashes, medium = ev
            assert medium == "GPU"
            out += hashes
    return out
