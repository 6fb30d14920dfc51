"""KV events: the worker's log (bounded, numbered, mirrored) and the router's index (gaps,
snapshots, replay), against each other without a wire; tests/integration/test_kv_events.py
runs them over real gRPC."""
from __future__ import annotations

import random

import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.block_pool import BlockPool
from pdserve.proto.pdserve.v1 import kv_events_pb2
from pdserve.router.kv_index import KVIndex
from pdserve.worker.kv_events import KVEventLog


def sync(index: KVIndex, log: KVEventLog) -> None:
    index.begin_sync()
    assert index.finish_sync(log.snapshot())


def index_of(index: KVIndex) -> dict[str, set[int]]:
    return {tier: held for tier, held in index.tiers.items() if held}


def log_of(log: KVEventLog) -> dict[str, set[int]]:
    return {tier: log.holds(tier) for tier in ("device", "host", "disk", "redis") if log.holds(tier)}


def test_a_pool_tells_what_it_caches_and_evicts():
    pool, log = BlockPool(4), KVEventLog()
    pool.on_event = log.on_event
    blocks = pool.try_allocate(3)
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, 100 + i)
    assert log.holds("device") == {100, 101, 102}
    pool.free(blocks)
    pool.try_allocate(2)  # evicts the two least recently freed cached blocks
    assert len(log.holds("device")) == 1
    batch = log.take_batch()
    assert batch.first_seq == 1  # one stored event (merged), then one removed event
    assert [(e.kind, sorted(e.block_hashes)) for e in batch.events] == [
        (kv_events_pb2.KV_EVENT_KIND_STORED, [100, 101, 102]),
        (kv_events_pb2.KV_EVENT_KIND_REMOVED, sorted({100, 101, 102} - log.holds("device")))]
    assert log.take_batch().first_seq == 3 and not log.take_batch().events  # a probe: the next number


def test_a_full_buffer_drops_never_blocks_and_the_router_recovers_by_snapshot():
    log, index = KVEventLog(max_pending_events=4), KVIndex()
    sync(index, log)
    for i in range(10):  # alternate tiers: no merging; 6 of 10 dropped
        log.on_event("device" if i % 2 else "host", "stored", [i])
    assert log.num_dropped == 6
    assert index.apply(log.take_batch())  # events 1-4 follow on; 5-10 are gone
    log.on_event("disk", "stored", [99])
    assert not index.apply(log.take_batch())  # event 11: the gap shows
    assert index_of(index) != log_of(log)
    sync(index, log)
    assert index_of(index) == log_of(log)


def test_batches_held_during_a_snapshot_replay_past_it():
    log, index = KVEventLog(), KVIndex()
    log.on_event("device", "stored", [1, 2])
    early = log.take_batch()
    index.begin_sync()  # the snapshot is on its way; the router holds what arrives meanwhile
    log.on_event("device", "stored", [3])  # merges into no sealed event...
    snapshot = log.snapshot()
    log.on_event("device", "stored", [4])  # ...nor into one the snapshot covered
    log.on_event("host", "stored", [1])
    late = log.take_batch()
    assert index.apply(early) and index.apply(late)
    assert index.finish_sync(snapshot)
    assert index_of(index) == log_of(log) == {"device": {1, 2, 3, 4}, "host": {1}}
    assert index.next_seq == log.take_batch().first_seq


def test_a_new_incarnation_is_a_gap():
    old, index = KVEventLog(), KVIndex()
    sync(index, old)
    restarted = KVEventLog()
    restarted.on_event("device", "stored", [5])
    assert not index.apply(restarted.take_batch())
    sync(index, restarted)
    assert index_of(index) == {"device": {5}}


def test_random_traffic_with_drops_converges_to_the_workers_contents():
    rng = random.Random(7)
    log, index = KVEventLog(max_pending_events=8, batch_events=4), KVIndex()
    sync(index, log)
    for _ in range(300):
        tier = rng.choice(["device", "host", "disk"])
        log.on_event(tier, rng.choice(["stored", "stored", "removed"]), [rng.randrange(40)])
        if rng.random() < 0.2:
            batch = log.take_batch()
            if rng.random() < 0.2:
                continue  # lost on the way (a router's queue overflowed)
            if not index.apply(batch):
                sync(index, log)
    if not index.apply(log.take_batch()):
        sync(index, log)
    assert index_of(index) == log_of(log)
    assert log.num_dropped > 0 and index.num_gaps > 0


def test_the_index_is_bounded_and_refuses_unknown_tiers():
    index = KVIndex(max_blocks=5)
    index.begin_sync()
    index.finish_sync(kv_events_pb2.KVSnapshotResponse(incarnation=1, last_seq=0))
    assert index.apply(kv_events_pb2.KVEventBatch(incarnation=1, first_seq=1, events=[
        kv_events_pb2.KVEvent(tier="device", kind=kv_events_pb2.KV_EVENT_KIND_STORED, block_hashes=range(50))]))
    assert index.num_blocks == 5
    with pytest.raises(InvalidRequestError):
        index.apply(kv_events_pb2.KVEventBatch(incarnation=1, first_seq=2, events=[
            kv_events_pb2.KVEvent(tier="tape", kind=kv_events_pb2.KV_EVENT_KIND_STORED, block_hashes=[1])]))


def test_batches_are_bounded_and_contiguous():
    log, index = KVEventLog(batch_events=3), KVIndex()
    sync(index, log)
    for i in range(8):
        log.on_event("device" if i % 2 else "host", "stored", [i])
    batches = [log.take_batch() for _ in range(4)]
    assert [len(b.events) for b in batches] == [3, 3, 2, 0] and [b.first_seq for b in batches] == [1, 4, 7, 9]
    assert all(index.apply(b) for b in batches)
    assert index_of(index) == log_of(log)


def test_after_a_drop_nothing_joins_the_buffer_until_it_is_empty():
    log, index = KVEventLog(max_pending_events=4, batch_events=2), KVIndex()
    sync(index, log)
    for i in range(6):
        log.on_event("device" if i % 2 else "host", "stored", [i])  # 5 and 6 dropped
    assert index.apply(log.take_batch())  # 1-2
    log.on_event("disk", "stored", [50])  # 7: would sit after 3-4 as if it were 5: dropped too
    assert index.apply(log.take_batch())  # 3-4
    assert log.num_dropped == 3
    log.on_event("disk", "stored", [51])  # 8: the buffer is empty again
    assert not index.apply(log.take_batch())  # starts at 8, expected 5: a gap
    sync(index, log)
    assert index_of(index) == log_of(log)
