"""KV-cache events in vLLM's wire format, for routers that route on what each replica has cached
(llm-d's KV indexer for the Gateway API Inference Extension's precise prefix scorer, and others
that read vLLM's events).

``qwen-trt serve --kv-events ENDPOINT`` makes the engine process publish, after every step in
which the prefix cache changed, one batch on a ZMQ PUB socket. Wire format (vLLM's
``vllm/distributed/kv_events.py``, the array layout its consumers decode):

- a message has three frames: the topic (``--kv-events-topic``, default empty), the batch's
  sequence number (8 bytes, big-endian, from 0 for each engine process), the msgpack payload;
- the payload is ``[ts, [event, ...]]`` (``EventBatch``: wall-clock seconds, the events in order);
- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name]``: full blocks that became reusable, a chain (each block's parent is the one before
  it, the first one's is ``parent_block_hash``, None at the start of a prompt); ``token_ids`` are
  the blocks' tokens, ``block_size`` per block; ``lora_id`` / ``lora_name`` None; medium "GPU";
- ``["BlockRemoved", block_hashes, medium]``: cached blocks evicted (their KV overwritten);
- ``["AllBlocksCleared"]``: sent first by every engine process (a restarted engine holds
  nothing, whatever a consumer knew of the previous one).

A block's hash is a 63-bit content hash of its parent's hash and its token ids, so the same
prefix has the same hashes on every replica and across restarts. Endpoint as vLLM's: one with
``*`` (``tcp://*:5557``) or ``ipc://`` binds, any other (``tcp://indexer:5557``) connects to a
subscriber that binds (llm-d's layout). The events hold prompt token ids: a bound socket on a
non-loopback address publishes them to whoever connects.

The block allocator (:class:`~qwen_trt.serving.kv_blocks.BlockAllocator`) calls
:meth:`KvEventPublisher.stored` / :meth:`removed` as it registers and evicts; the worker wraps its
runner (:func:`publishing`) so each step's events leave as one batch, from the engine process
itself. Needs ``pyzmq`` and ``msgpack`` (``pip install 'qwen-trt[kv-events]'``).
"""
from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from qwen_trt.errors import ConfigError, QwenTrtError

MEDIUM = "GPU"
HWM = 100_000               # batches a slow subscriber may fall behind before they are dropped


@dataclass(frozen=True)
class KvEventsConfig:
    endpoint: str            # checked by qwen_trt.api.server_settings.ServerSettings
    topic: str = ""

    @property
    def binds(self) -> bool:
        return "*" in self.endpoint or self.endpoint.startswith("ipc://")


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """The hash of a block whose parent block hashes to ``parent`` (None: the prompt's first)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "big"))
    h.update(array("Q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "big") >> 1


class KvEventLog:
    """The allocator's listener: its stores and evictions as vLLM events, kept until
    :meth:`take` (consecutive stores of one chain, and consecutive removals, share an event)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._hashes: dict[int, int] = {}       # the allocator's key id -> the block's hash
        self._events: list[list] = []

    def stored(self, parent_key: int, key: int, token_ids: Sequence[int]) -> None:
        parent = self._hashes.get(parent_key) if parent_key else None
        h = block_hash(parent, token_ids)
        self._hashes[key] = h
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "BlockStored" and parent is not None \
                and last[1][-1] == parent:
            last[1].append(h)
            last[3].extend(token_ids)
        else:
            self._events.append(["BlockStored", [h], parent, list(token_ids), self.block_size,
                                 None, MEDIUM, None])

    def removed(self, key: int) -> None:
        h = self._hashes.pop(key, None)
        if h is None:
            return
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "BlockRemoved":
            last[1].append(h)
        else:
            self._events.append(["BlockRemoved", [h], MEDIUM])

    def cleared(self) -> None:
        self._hashes.clear()
        self._events.append(["AllBlocksCleared"])

    def take(self) -> list[list]:
        events, self._events = self._events, []
        return events


class KvEventPublisher(KvEventLog):
    """:class:`KvEventLog` whose :meth:`flush` sends the events so far as one batch."""

    def __init__(self, config: KvEventsConfig, block_size: int) -> None:
        super().__init__(block_size)
        try:
            import msgpack
            import zmq
        except ImportError:
            raise ConfigError("--kv-events needs pyzmq and msgpack: pip install "
                              "'qwen-trt[kv-events]'.") from None
        self._pack = msgpack.packb
        self._again = zmq.Again
        self._noblock = zmq.NOBLOCK
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, HWM)
        self._sock.setsockopt(zmq.LINGER, 1000)
        try:
            (self._sock.bind if config.binds else self._sock.connect)(config.endpoint)
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise QwenTrtError(f"--kv-events {config.endpoint}: cannot "
                               f"{'bind' if config.binds else 'connect'} ({e}).") from None
        self._topic = config.topic.encode()
        self.seq = 0
        self.dropped = 0
        self.cleared()
        self.flush()

    def flush(self) -> None:
        events = self.take()
        if not events:
            return
        payload = self._pack([time.time(), events])
        try:
            self._sock.send_multipart([self._topic, self.seq.to_bytes(8, "big"), payload],
                                      flags=self._noblock)
        except self._again:        # the subscriber is HWM batches behind: it misses this one
            self.dropped += 1
        self.seq += 1

    def close(self) -> None:
        self.flush()
        self._sock.close()
        self._ctx.term()


class PublishingRunner:
    """A runner whose every step ends by sending that step's KV events (all else delegated)."""

    def __init__(self, runner, publisher: KvEventPublisher) -> None:
        self._runner = runner
        self.publisher = publisher

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def step(self):
        try:
            return self._runner.step()
        finally:
            self.publisher.flush()


def publishing(runner, config: KvEventsConfig, say=None):
    """``runner`` publishing its block allocator's events; a runner without one of its own (the
    TensorRT-LLM executor, the serial runner) is returned as it is, with one line to ``say``."""
    alloc = getattr(runner, "alloc", None)
    if alloc is None or not hasattr(alloc, "listener"):
        if say is not None:
            say("--kv-events: this engine's runner keeps no KV blocks of qwen-trt's own; no "
                "events are published")
        return runner
    publisher = KvEventPublisher(config, alloc.block_size)
    alloc.listener = publisher
    if say is not None:
        say(f"publishing KV-cache events: {'bound to' if config.binds else 'connected to'} "
            f"{config.endpoint}")
    return PublishingRunner(runner, publisher)
