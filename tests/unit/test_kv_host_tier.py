"""The host tier and the offload under the pool, as units over real tensors: bounds,
digests, memory freed on close, and the ordering rule (an evicted block's bytes are copied
before anything may write the block again)."""
from __future__ import annotations

import threading

import pytest
import torch

from pdserve.engine.block_pool import EvictedBlock
from pdserve.kvtransfer.tiers import HostTier, Offloader, TierStats
from pdserve.kvtransfer.tiers import offload as offload_module
from support import wait_until

SHAPE = (2, 2, 4, 1, 8)  # layers, k/v, block size, heads, head dim
BLOCK_BYTES = 2 * 2 * 4 * 1 * 8 * 4


def blocks(n: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(n * BLOCK_BYTES // 4, dtype=torch.float32).reshape(n, *SHAPE) + start


def test_full_tier_evicts_lru_to_the_tier_below_and_never_grows():
    demoted, events = [], []
    tier = HostTier(3 * BLOCK_BYTES + 7, SHAPE, torch.float32, demote=demoted.extend,
                    on_event=lambda tier, kind, hashes: events.append((tier, kind, list(hashes))))
    assert tier.capacity_blocks == 3
    data = blocks(5)
    assert tier.put([1, 2, 3], [b"a", b"b", b"c"], data[:3]) == 3
    tier.match([1], [b"a"])  # 1 is used again: 2 is now the least recently used
    assert tier.put([4, 5], [b"d", b"e"], data[3:]) == 2
    assert len(tier) == 3 and tier.stats.blocks == 3 and tier.stats.bytes == 3 * BLOCK_BYTES
    assert [(key, digest) for key, digest, _ in demoted] == [(2, b"b"), (3, b"c")]
    assert torch.equal(demoted[0][2], data[1]) and torch.equal(demoted[1][2], data[2])  # copies, taken before reuse
    assert tier.stats.evictions == 2
    assert ("host", "removed", [2, 3]) in events and ("host", "stored", [4, 5]) in events
    got = tier.match([1, 4, 5], [b"a", b"d", b"e"])
    assert [torch.equal(g, w) for g, w in zip(got, (data[0], data[3], data[4]))] == [True] * 3


def test_a_hit_must_carry_the_requests_digest():
    tier = HostTier(4 * BLOCK_BYTES, SHAPE, torch.float32)
    tier.put([1, 2], [b"a", b"b"], blocks(2))
    assert len(tier.match([1, 2], [b"a", b"other prefix"])) == 1  # the run stops at the mismatch
    assert tier.stats.corrupt == 1
    assert tier.match([7, 1], [b"x", b"a"]) == []  # a run starts at the first block


def test_close_frees_the_memory_and_a_tiny_budget_is_off():
    tier = HostTier(2 * BLOCK_BYTES, SHAPE, torch.float32)
    tier.put([1], [b"a"], blocks(1))
    tier.close()
    assert tier._buffer is None and len(tier) == 0 and tier.stats.bytes == 0
    assert tier.put([2], [b"b"], blocks(1)) == 0 and tier.match([1], [b"a"]) == []
    off = HostTier(BLOCK_BYTES - 1, SHAPE, torch.float32)
    assert not off.stats.enabled and "smaller than one block" in off.stats.reason


def test_fence_waits_for_the_copy_and_the_copy_holds_the_bytes_before_reuse(monkeypatch):
    caches = [torch.zeros(6, *SHAPE[1:]) for _ in range(SHAPE[0])]
    for layer, cache in enumerate(caches):
        cache[3] = 100 + layer
    tier = HostTier(4 * BLOCK_BYTES, SHAPE, torch.float32)
    release = threading.Event()
    real_gather = offload_module.gather_to_host

    def held_gather(kv_caches, block_ids):
        assert release.wait(10)
        return real_gather(kv_caches, block_ids)

    monkeypatch.setattr(offload_module, "gather_to_host", held_gather)
    offloader = Offloader(tier.put, tier.stats)
    offloader.attach(caches)
    offloader.evicted([EvictedBlock(3, 42, b"d")])
    fenced = threading.Event()
    waiter = threading.Thread(target=lambda: (offloader.fence(10), fenced.set()))
    waiter.start()
    assert not fenced.wait(0.2)  # the copy is held: the fence holds the step
    release.set()
    waiter.join(10)
    assert fenced.is_set()
    for cache in caches:  # the block is written again only now
        cache[3] = -1
    wait_until(lambda: tier.holds(42), "the offloaded block in the host tier")
    (got,) = tier.match([42], [b"d"])
    assert torch.equal(got[0], torch.full(SHAPE[1:], 100.0)) and torch.equal(got[1], torch.full(SHAPE[1:], 101.0))
    offloader.close()


def test_a_copy_late_past_the_fence_is_cancelled_never_stored(monkeypatch):
    caches = [torch.ones(4, *SHAPE[1:]) for _ in range(SHAPE[0])]
    tier = HostTier(4 * BLOCK_BYTES, SHAPE, torch.float32)
    release = threading.Event()
    real_gather = offload_module.gather_to_host
    monkeypatch.setattr(offload_module, "gather_to_host",
                        lambda kv, ids: (release.wait(10), real_gather(kv, ids))[1])
    offloader = Offloader(tier.put, tier.stats)
    offloader.attach(caches)
    offloader.evicted([EvictedBlock(1, 9, b"z")])
    offloader.fence(0.05)  # past its deadline: cancelled
    release.set()
    wait_until(lambda: tier.stats.dropped == 1, "the late copy dropped")
    assert not tier.holds(9)
    offloader.close()


def test_offload_queue_is_bounded():
    stats = TierStats("host")
    gate = threading.Event()
    offloader = Offloader(lambda *a: gate.wait(10), stats, max_pending_blocks=2)
    offloader.attach([torch.zeros(4, *SHAPE[1:]) for _ in range(SHAPE[0])])
    offloader.evicted([EvictedBlock(1, 1, None), EvictedBlock(2, 2, None)])
    offloader.evicted([EvictedBlock(3, 3, None)])  # over the bound while the first two wait
    assert stats.dropped >= 1
    gate.set()
    offloader.fence(10)
    offloader.close()
