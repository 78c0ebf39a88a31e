"""KV-cache events in vLLM's wire format (qwen_trt/serving/kv_events.py), read by a ZMQ SUB the way
llm-d's KV indexer reads them: the allocator's stores and evictions, exactly, in a unit test; then
a real ``qwen-trt serve --kv-events`` on the tiny model (engine process, batched runner), whose
events must name the blocks of the prompts it served and, once the 8192-token cache overflows,
the blocks it evicted."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from qwen_trt.serving.kv_blocks import BlockAllocator, SeqBlocks  # noqa: E402
from qwen_trt.serving.kv_events import (KvEventPublisher, KvEventsConfig,  # noqa: E402
                                        block_hash)
from servers import free_port, start_serve  # noqa: E402

TOPIC = "kv@test@tiny"


class Subscriber:
    """A SUB socket that binds (llm-d's layout: the engines connect to the indexer), read by its
    own thread all along, as an indexer reads (a SUB socket that nobody polls does not pass its
    subscription on to a publisher that connects, which then drops everything)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.batches: list[tuple[int, float, list]] = []
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
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        sock.bind(self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(50):
                    continue
                topic, seq, payload = sock.recv_multipart()
                assert topic == TOPIC.encode() and len(seq) == 8
                ts, events = msgpack.unpackb(payload)     # EventBatch, array layout
                with self._lock:
                    self.batches.append((int.from_bytes(seq, "big"), ts, events))
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

    def events(self) -> list:
        with self._lock:
            return [ev for _, _, evs in self.batches for ev in evs]

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


@pytest.fixture
def sub():
    s = Subscriber()
    yield s
    s.close()


def test_the_allocator_stores_and_evictions_arrive_as_vllm_events(sub):
    alloc = BlockAllocator(num_blocks=5, block_size=4)      # 4 usable blocks
    pub = KvEventPublisher(KvEventsConfig(sub.endpoint, TOPIC), alloc.block_size)
    alloc.listener = pub
    try:
        # the PUB side connects; wait until the subscription has reached it
        deadline = time.monotonic() + 10
        while not sub.events() and time.monotonic() < deadline:
            pub.cleared()
            pub.flush()
            sub.wait(lambda evs: evs, timeout=0.2)
        assert sub.events()[0] == ["AllBlocksCleared"]
        sub.clear()
        a = list(range(100, 112))                 # three full blocks
        s1 = SeqBlocks()
        alloc.grow(s1, len(a))
        alloc.register_full(s1, a, len(a))
        pub.flush()
        alloc.free(s1)
        b = list(range(200, 216))                 # four more: evicts all three of a's
        s2 = SeqBlocks()
        alloc.grow(s2, len(b))
        alloc.register_full(s2, b, len(b))
        pub.flush()
        events = sub.wait(lambda evs: len(evs) >= 3)
    finally:
        pub.close()
    stored = stored_blocks(events)
    assert [ev[0] for ev in events] == ["BlockStored", "BlockRemoved", "BlockStored"]
    assert events[0][2] is None and events[0][3] == a      # one chain from the prompt's start
    assert events[2][3] == b
    # a's three blocks, the ones evicted: tail first (a finished sequence frees its tail first)
    assert removed_blocks(events) == events[0][1][::-1]
    assert alloc.evictions == 3 and len(stored) == 7
    assert [s for s, _, _ in sub.batches] == sorted(s for s, _, _ in sub.batches)


@pytest.mark.slow
def test_a_replica_reports_the_blocks_it_stored_and_evicted(tiny_model_dir, tmp_path, sub):
    served = start_serve(tiny_model_dir, tmp_path, "--served-model-name", "tiny", "--fast", "on",
                         "--kv-events", sub.endpoint, "--kv-events-topic", TOPIC,
                         env={"QWEN_TRT_WORKER": "process"})
    try:
        # (the engine's first batch, AllBlocksCleared, may leave before the subscription has
        # reached it: a PUB socket drops what no subscriber asked for yet)
        prompts = []
        with httpx.Client(base_url=served.url, timeout=120) as client:
            for i in range(3):       # 3 x ~2.9k tokens: more than the 8192-token CPU cache
                msgs = [{"role": "user", "content": " ".join(f"p{i}w{k % 97}"
                                                             for k in range(590))}]
                r = client.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": msgs, "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text[:200]
                ids = client.post("/tokenize", json={"messages": msgs}).json()["tokens"]
                assert len(ids) > 2048
                prompts.append(ids)
        events = sub.quiet()
    finally:
        served.stop()
    stored = stored_blocks(events)
    bs = next(ev[4] for ev in events if ev[0] == "BlockStored")
    chains = []
    for ids in prompts:     # each prompt's full blocks were stored, as one chain from its start
        parent, chain = None, []
        for k in range((len(ids) - 1) // bs):
            h = block_hash(parent, ids[k * bs:(k + 1) * bs])
            assert stored.get(h) == (parent, ids[k * bs:(k + 1) * bs]), (k, len(ids))
            parent = h
            chain.append(h)
        chains.append(chain)
    removed = removed_blocks(events)
    assert removed, "3 prompts of ~2.9k tokens overflow the cache: blocks were evicted"
    assert len(set(removed)) == len(removed)
    # LRU: the evicted blocks are the first prompt's, its tail first (the third needed room)
    assert set(removed) <= set(chains[0]), (len(removed), len(set(removed) - set(chains[0])))
    assert chains[0][-1] in removed and chains[0][0] not in removed
