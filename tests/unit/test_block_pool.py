"""Block pool: ref counts, the LRU free list (eviction order) and the prefix-cache map."""
from __future__ import annotations

import pytest

from pdserve.engine.block_pool import NULL_BLOCK_ID, BlockPool


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert pool.get_num_free_blocks() == 4
    blocks = pool.try_allocate(4)
    assert NULL_BLOCK_ID not in ids(blocks)
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_num_free_blocks() == 0
    pool.free(blocks)
    pool.assert_all_free()


def test_allocation_fails_whole_when_short():
    pool = BlockPool(4)
    held = pool.try_allocate(2)
    assert pool.try_allocate(2) is None
    assert pool.get_num_free_blocks() == 1  # nothing was taken by the failed call
    pool.free(held)
    pool.assert_all_free()


def test_pool_needs_a_usable_block():
    with pytest.raises(ValueError):
        BlockPool(1)


def test_double_free_is_refused():
    pool = BlockPool(3)
    (block,) = pool.try_allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([block])


def test_freeing_the_null_block_is_a_no_op():
    pool = BlockPool(3)
    pool.free([pool.blocks[NULL_BLOCK_ID]])
    pool.assert_all_free()


def test_leak_check_names_held_blocks():
    pool = BlockPool(4)
    held = pool.try_allocate(1)
    with pytest.raises(AssertionError, match=str(held[0].block_id)):
        pool.assert_all_free()


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(5)
    a, b, c, d = pool.try_allocate(4)
    pool.cache_full_block(a, 111)
    pool.cache_full_block(b, 222)
    pool.free([a, b])  # cached: kept at the back, in LRU order
    pool.free([c])  # uncached: front, reused first
    (first,) = pool.try_allocate(1)
    assert first is c
    assert pool.get_cached_block(111) is a and pool.get_cached_block(222) is b
    (second,) = pool.try_allocate(1)  # now an eviction: the least recently freed cached block
    assert second is a
    assert second.block_hash is None
    assert pool.get_cached_block(111) is None
    assert pool.get_cached_block(222) is b
    assert pool.num_evictions == 1
    pool.free([first, second, d])
    pool.assert_all_free()


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(4)
    (a,) = pool.try_allocate(1)
    pool.cache_full_block(a, 7)
    pool.free([a])
    assert pool.get_num_free_blocks() == 3
    hit = pool.get_cached_block(7)
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.get_num_free_blocks() == 2
    # the revived block is not evictable: allocating everything else leaves it alone
    others = pool.try_allocate(2)
    assert pool.try_allocate(1) is None
    assert pool.get_cached_block(7) is a
    pool.free(others + [a])
    pool.assert_all_free()


def test_shared_block_stays_held_until_last_reference():
    pool = BlockPool(3)
    (a,) = pool.try_allocate(1)
    pool.cache_full_block(a, 5)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free([a])
    assert pool.get_num_free_blocks() == 1
    pool.free([a])
    assert pool.get_num_free_blocks() == 2
    assert pool.get_cached_block(5) is a  # still cached while free


def test_first_writer_wins_for_a_hash():
    pool = BlockPool(4)
    a, b = pool.try_allocate(2)
    pool.cache_full_block(a, 9)
    pool.cache_full_block(b, 9)
    assert pool.get_cached_block(9) is a
    assert b.block_hash is None
    pool.cache_full_block(a, 10)  # a block keeps its first hash
    assert a.block_hash == 9 and pool.get_cached_block(10) is None
    pool.free([a, b])


def test_caching_disabled_never_publishes():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.try_allocate(1)
    pool.cache_full_block(a, 1)
    assert pool.get_cached_block(1) is None
    assert pool.cached_hashes() == []
    pool.free([a])
    pool.assert_all_free()


def test_reset_prefix_cache_drops_only_free_blocks():
    pool = BlockPool(4)
    a, b = pool.try_allocate(2)
    pool.cache_full_block(a, 1)
    pool.cache_full_block(b, 2)
    pool.free([a])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(1) is None
    assert pool.get_cached_block(2) is b  # in use: kept
    pool.free([b])
    pool.assert_all_free()
