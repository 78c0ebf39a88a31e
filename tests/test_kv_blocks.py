"""The paged-KV block allocator: refcounts, prefix reuse by chained hashes, LRU eviction."""
from __future__ import annotations

import pytest

from qwen_trt.serving.kv_blocks import SCRATCH_BLOCK, BlockAllocator, OutOfBlocksError, SeqBlocks


def _seq(alloc: BlockAllocator, tokens: list[int]) -> tuple[SeqBlocks, int]:
    """What the scheduler does for a new request that then computes all of its tokens."""
    s = SeqBlocks()
    hit = alloc.match_prefix(s, tokens)
    alloc.grow(s, len(tokens))
    alloc.register_full(s, tokens, len(tokens))
    return s, hit


def test_allocate_and_free_counts():
    a = BlockAllocator(9, block_size=4)
    assert a.num_usable == 8 and a.num_free == 8
    s = SeqBlocks()
    a.grow(s, 10)                                   # 3 blocks
    assert len(s.table) == 3 and a.num_free == 5
    assert SCRATCH_BLOCK not in s.table
    assert all(a.refs(b) == 1 for b in s.table)
    a.grow(s, 12)                                   # still 3
    assert len(s.table) == 3
    a.free(s)
    assert a.num_free == 8 and s.table == []
    with pytest.raises(OutOfBlocksError):
        a.allocate(9)


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    a = BlockAllocator(17, block_size=4)
    prompt = list(range(100, 110))                  # 10 tokens: 2 full blocks + 2
    s1, hit = _seq(a, prompt)
    assert hit == 0
    s2, hit = _seq(a, prompt + [7, 8, 9])
    assert hit == 8                                 # both full blocks reused
    assert s2.table[:2] == s1.table[:2]
    assert a.refs(s1.table[0]) == 2
    # exactly two full blocks: one token must stay to compute, so only the first block hits
    s3, hit = _seq(a, prompt[:8])
    assert hit == 4
    # a different first block breaks the chain even if the second block's tokens match
    other = [1, 2, 3, 4] + prompt[4:]
    s4, hit = _seq(a, other)
    assert hit == 0
    for s in (s1, s2, s3, s4):
        a.free(s)
    assert a.num_free == a.num_usable


def test_freed_blocks_stay_cached_until_pressure_then_lru():
    a = BlockAllocator(7, block_size=2)             # 6 usable
    t1 = [1, 2, 3, 4, 5]                            # 3 blocks, 2 full
    s1, _ = _seq(a, t1)
    a.free(s1)
    st = a.stats()
    assert st.used == 0 and st.cached_free == 2
    # fresh blocks are handed out before cached ones: a 3-block request evicts nothing
    s2, _ = _seq(a, [9, 9, 8, 8, 7])
    assert a.evictions == 0
    a.free(s2)
    s3, hit = _seq(a, t1 + [6])
    assert hit == 4                                 # t1's KV survived
    a.free(s3)
    # pressure: 6 fresh blocks needed -> every cached block is evicted, tails first
    big = SeqBlocks()
    a.grow(big, 12)
    assert a.evictions > 0
    a.free(big)
    s4, hit = _seq(a, t1)
    assert hit == 0


def test_eviction_order_is_least_recently_freed_first():
    a = BlockAllocator(5, block_size=2)             # 4 usable
    sa, _ = _seq(a, [1, 1, 0])                      # 2 blocks, first one full and cached
    sb, _ = _seq(a, [2, 2, 0])
    a.free(sa)                                      # a freed first: older
    a.free(sb)
    blk = a.allocate(3)                             # 2 uncached + 1 eviction
    assert a.evictions == 1
    a.free(SeqBlocks(table=blk))
    _, hit_b = _seq(a, [2, 2, 0])
    assert hit_b == 2                               # b (more recent) survived
    s, hit_a = _seq(a, [1, 1, 0])
    assert hit_a == 0


def test_identical_prompts_in_flight_keep_private_duplicates():
    a = BlockAllocator(9, block_size=2)
    s1 = SeqBlocks()
    s2 = SeqBlocks()
    toks = [5, 6, 7]
    for s in (s1, s2):                              # both admitted before either computed
        assert a.match_prefix(s, toks) == 0
        a.grow(s, 3)
    a.register_full(s1, toks, 3)
    a.register_full(s2, toks, 3)                    # its duplicate stays uncached
    first = s1.table[0]
    a.free(s1)
    a.free(s2)
    assert a.stats().cached_free == 1
    s3, hit = _seq(a, toks)
    assert hit == 2 and s3.table[0] == first


def test_prefix_caching_off_never_hits():
    a = BlockAllocator(9, block_size=2, prefix_caching=False)
    s1, _ = _seq(a, [1, 2, 3, 4, 5])
    a.free(s1)
    _, hit = _seq(a, [1, 2, 3, 4, 5])
    assert hit == 0 and a.stats().cached_free == 0


def test_double_free_is_caught():
    a = BlockAllocator(3, block_size=2)
    s = SeqBlocks()
    a.grow(s, 2)
    table = list(s.table)
    a.free(s)
    with pytest.raises(AssertionError):
        a.free(SeqBlocks(table=table))
