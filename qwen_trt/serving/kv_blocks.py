"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, prefix reuse.

Host-side only (plain Python): which physical block holds which tokens. The tensors live in
:class:`qwen_trt.fast.step.batched.PagedKVCache`; token ``t`` of a sequence sits in physical block
``table[t // block_size]`` at offset ``t % block_size``.

**Block size 32** (the default): TensorRT-LLM's default ``tokens_per_block``; one block is a
32-row tile for the attention kernel (a 64-slot split is two blocks); 4.5 MiB per block on
Qwen3-4B (144 KiB per token). Smaller blocks (vLLM's 16) would reuse up to 15 more tokens per
turn boundary, which at ~300 tokens per chat turn saves little and doubles table lookups.

**Prefix reuse by chained block hashes** (vLLM's automatic prefix caching: vllm-project/vllm:docs/design/prefix_caching.md):
a *full* block is keyed by ``(key of the previous block, its token ids)``; the dict maps the
key to the block that holds that KV. A chain key means a block is only reused when every token
before it matches too (the KV of a token depends on all earlier ones). Each registered key gets
a fresh integer id that its children's keys name, so a key is O(block) to hash (not the whole
prefix) and holds the token ids themselves: two different prefixes can never collide. Children
of an evicted block become unreachable (lookups walk from the first block) and age out. We picked this over a
radix tree (SGLang): a chat turn hits whole blocks of its history, the hash map is a few lines,
and it is what the TensorRT-LLM backend does too (full blocks only).

**Eviction.** A block whose last user left goes on the free queue but keeps its key: a later
request can still hit it. Allocation takes never-cached blocks first, then evicts the least
recently freed cached one (LRU), so cached KV is only dropped under memory pressure. A
finished sequence frees its blocks tail first, so its tail is evicted before its head (the
head is the part other turns share).

Block 0 is reserved as a scratch block: padded rows of a CUDA-graph batch write their K/V there.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from qwen_trt.errors import QwenTrtError
from qwen_trt.fast.model.kv_cache import DEFAULT_BLOCK_SIZE, SCRATCH_BLOCK  # noqa: F401  (the paged layout's)

BlockKey = tuple  # (id of the parent block's key, 0 for the first block; its token ids)


class OutOfBlocksError(QwenTrtError):
    """The KV cache has no free block left (the scheduler preempts or waits)."""


@dataclass
class _Block:
    id: int
    refs: int = 0
    key: BlockKey | None = None     # set once the block is full and registered for reuse
    key_id: int = 0                 # the id its children's keys name


@dataclass
class AllocatorStats:
    total: int                      # usable blocks (the scratch block excluded)
    used: int                       # held by at least one sequence
    cached_free: int                # free but still holding reusable KV
    hits: int = 0                   # cumulative blocks served from the cache
    evictions: int = 0              # cumulative cached blocks overwritten


@dataclass
class SeqBlocks:
    """One sequence's block table and how much of it is registered for reuse."""

    table: list[int] = field(default_factory=list)
    hashed: int = 0                 # leading blocks registered in the prefix cache
    last_key: int = 0               # key id of the last of them (0: none)


class BlockAllocator:
    """Reference-counted blocks with prefix reuse and LRU eviction of free cached blocks."""

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is scratch), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._blocks[SCRATCH_BLOCK].refs = 1        # never handed out
        # Free blocks in eviction order: never-cached ones at the front, then cached ones by
        # the time they were freed (least recently used first).
        self._free: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(1, num_blocks))
        self._cached: dict[BlockKey, int] = {}
        self._next_key_id = 1
        self._cached_free = 0       # free blocks that still hold reusable KV
        self.hits = 0
        self.evictions = 0
        # told of every block registered for reuse (stored(parent key id, key id, token ids))
        # and every registered block evicted (removed(key id)): serving.kv_events
        self.listener = None

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def refs(self, block: int) -> int:
        return self._blocks[block].refs

    def stats(self) -> AllocatorStats:
        return AllocatorStats(total=self.num_usable, used=self.num_usable - self.num_free,
                              cached_free=self._cached_free, hits=self.hits,
                              evictions=self.evictions)

    # ---- prefix reuse --------------------------------------------------------------------
    def _chunks(self, token_ids: Sequence[int], n_blocks: int):
        bs = self.block_size
        for i in range(n_blocks):
            yield tuple(token_ids[i * bs:(i + 1) * bs])

    def match_prefix(self, seq: SeqBlocks, token_ids: Sequence[int]) -> int:
        """Attach the longest run of cached full blocks that starts ``token_ids`` to the empty
        ``seq``; returns the number of tokens they cover. At least one token is always left to
        compute (its logits pick the first new token)."""
        if seq.table:
            raise ValueError("match_prefix needs an empty block table")
        if not self.prefix_caching:
            return 0
        key = 0
        for chunk in self._chunks(token_ids, (len(token_ids) - 1) // self.block_size):
            block = self._cached.get((key, chunk))
            if block is None:
                break
            self._take(block)
            seq.table.append(block)
            key = self._blocks[block].key_id
        seq.hashed = len(seq.table)
        seq.last_key = key
        self.hits += len(seq.table)
        return len(seq.table) * self.block_size

    def register_full(self, seq: SeqBlocks, token_ids: Sequence[int], computed: int) -> None:
        """Make the full blocks among the first ``computed`` tokens (whose KV is written)
        reusable. A block whose key is already cached elsewhere (two identical prompts in
        flight) stays private to this sequence."""
        if not self.prefix_caching:
            return
        full = min(computed // self.block_size, len(seq.table))
        bs = self.block_size
        for i in range(seq.hashed, full):
            key = (seq.last_key, tuple(token_ids[i * bs:(i + 1) * bs]))
            block = self._blocks[seq.table[i]]
            cached = self._cached.get(key)
            if cached is not None:                 # an identical block exists: chain on it
                seq.last_key = self._blocks[cached].key_id
                continue
            if block.key is None:
                block.key = key
                block.key_id = self._next_key_id
                self._next_key_id += 1
                self._cached[key] = block.id
                if self.listener is not None:
                    self.listener.stored(seq.last_key, block.key_id, key[1])
            seq.last_key = block.key_id
        seq.hashed = max(seq.hashed, full)

    # ---- allocation ----------------------------------------------------------------------
    def _take(self, block: int) -> None:
        b = self._blocks[block]
        if b.refs == 0:
            del self._free[block]
            if b.key is not None:
                self._cached_free -= 1
        b.refs += 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (refcount 1); evicts the least recently freed cached blocks
        only when no never-cached block is left."""
        if n > len(self._free):
            raise OutOfBlocksError(f"KV cache full: need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            b = self._blocks[block]
            if b.key is not None:                  # evict: its KV is about to be overwritten
                if self._cached.get(b.key) == block:
                    del self._cached[b.key]
                if self.listener is not None:
                    self.listener.removed(b.key_id)
                b.key = None
                self._cached_free -= 1
                self.evictions += 1
            b.refs = 1
            out.append(block)
        return out

    def grow(self, seq: SeqBlocks, tokens: int) -> None:
        """Extend ``seq``'s table to hold ``tokens`` tokens."""
        need = self.blocks_for(tokens) - len(seq.table)
        if need > 0:
            seq.table += self.allocate(need)

    def free(self, seq: SeqBlocks) -> None:
        """Drop ``seq``'s references, tail first; blocks nobody holds become free (cached
        ones stay reusable until evicted)."""
        for block in reversed(seq.table):
            b = self._blocks[block]
            b.refs -= 1
            if b.refs < 0:
                raise AssertionError(f"block {block} freed twice")
            if b.refs == 0:
                self._free[block] = None
                if b.key is None:                  # nothing to keep: reuse it first
                    self._free.move_to_end(block, last=False)
                else:
                    self._cached_free += 1
        seq.table = []
        seq.hashed = 0
        seq.last_key = 0
