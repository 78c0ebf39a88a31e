"""KV-cache events in vLLM's wire format (qwen_trt/serving/kv_events.py), read by a ZMQ SUB the way
llm-d's KV indexer reads them: the block allocator's stores and evictions, exactly. A real
``qwen-trt serve --kv-events`` is checked in tests/test_gateway.py (its replicas publish)."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from kv_subscriber import Subscriber, removed_blocks, stored_blocks  # noqa: E402
from qwen_trt.serving.kv_blocks import BlockAllocator, SeqBlocks  # noqa: E402
from qwen_trt.serving.kv_events import KvEventPublisher, KvEventsConfig  # noqa: E402

TOPIC = "kv@test@tiny"


@pytest.fixture
def sub():
    s = Subscriber(TOPIC)
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
    seqs = [seq for _, seq, _, _ in sub.batches]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
