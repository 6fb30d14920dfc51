"""CacheSink: what may land in the cache, and when nothing may."""
from __future__ import annotations

import threading

import pytest

from pdserve.common.errors import TransferError
from pdserve.kvtransfer.base import BlockMessage
from pdserve.kvtransfer.codec import as_bytes_view, new_transfer_id
from pdserve.kvtransfer.sink import CacheSink
from kvcaches import block_digests, make_caches, message_from_cache, tiny_layout
from pdserve.kvtransfer.wire import WireError, parse_header
from support import FakeClock

LAYOUT = tiny_layout(num_blocks=16)
SOURCE = make_caches(LAYOUT, seed=1)
ZERO = block_digests(make_caches(LAYOUT), [0])[0]


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def sink(clock):
    return CacheSink(make_caches(LAYOUT), LAYOUT, clock=clock)


def wire(message: BlockMessage) -> bytes:
    return message.header + message.index + bytes(as_bytes_view(message.payload))


def test_expected_transfer_lands_bit_identical_and_completes(sink, clock):
    tid = new_transfer_id()
    sink.expect(tid, [7, 3, 9], deadline=clock.now + 5, tag="req-1")
    assert sink.reserved_block_ids == {3, 7, 9}
    sink.deliver(wire(message_from_cache(SOURCE, LAYOUT, tid, [1, 2, 4], [7, 3, 9])))
    assert block_digests(sink.kv_caches, [7, 3, 9]) == block_digests(SOURCE, [1, 2, 4])
    assert sink.is_complete(tid)
    assert [(e.tag, e.ok) for e in sink.take_events()] == [("req-1", True)]
    assert sink.pending_transfer_ids == set() and sink.reserved_block_ids == set()


def test_transfer_may_arrive_in_several_messages(sink, clock):
    tid = new_transfer_id()
    sink.expect(tid, [5, 6, 8], deadline=clock.now + 5)
    sink.deliver(wire(message_from_cache(SOURCE, LAYOUT, tid, [1], [6])))
    assert not sink.is_complete(tid) and sink.take_events() == []
    sink.deliver(wire(message_from_cache(SOURCE, LAYOUT, tid, [2, 3], [5, 8])))
    assert sink.is_complete(tid)
    assert block_digests(sink.kv_caches, [6, 5, 8]) == block_digests(SOURCE, [1, 2, 3])


def test_a_layer_wise_transfer_completes_only_with_every_layer_of_every_block(sink, clock):
    """Streamed messages carry one layer of some blocks each; the blocks are the owner's only
    when every layer of every one has landed. A whole-block message may rewrite what a broken
    stream already landed (the fallback re-sends the blocks whole)."""
    tid = new_transfer_id()
    sink.expect(tid, [5, 6, 8], deadline=clock.now + 5, tag="streamed")
    for layer in range(LAYOUT.num_layers):
        sink.deliver(wire(message_from_cache(SOURCE, LAYOUT, tid, [1, 2], [5, 6], layers=range(layer, layer + 1))))
    sink.deliver(wire(message_from_cache(SOURCE, LAYOUT, tid, [1], [5])))  # a rewrite
    for layer in range(LAYOUT.num_layers):
        assert not sink.is_complete(tid) and sink.take_events() == []
        sink.deliver(wire(message_from_cache(SOURCE, LAYOUT, tid, [3], [8], layers=range(layer, layer + 1))))
    assert sink.is_complete(tid) and [e.tag for e in sink.take_events()] == ["streamed"]
    assert block_digests(sink.kv_caches, [5, 6, 8]) == block_digests(SOURCE, [1, 2, 3])

    partial = new_transfer_id()
    sink.expect(partial, [9], deadline=clock.now + 5, tag="half")
    sink.deliver(wire(message_from_cache(SOURCE, LAYOUT, partial, [4], [9], layers=range(0, 1))))
    clock.now += 10
    sink.expire_overdue()
    events = sink.take_events()
    assert [(e.tag, e.ok) for e in events] == [("half", False)] and "1 incomplete" in events[0].reason


def test_unknown_duplicate_and_aborted_ids_are_refused(sink, clock):
    message = message_from_cache(SOURCE, LAYOUT, new_transfer_id(), [1], [2])
    with pytest.raises(TransferError, match="unknown"):
        sink.deliver(wire(message))
    sink.expect(message.transfer_id, [2], clock.now + 5)
    sink.deliver(wire(message))
    with pytest.raises(TransferError, match="duplicate"):
        sink.deliver(wire(message))
    with pytest.raises(TransferError, match="already known"):
        sink.expect(message.transfer_id, [4], clock.now + 5)

    aborted = message_from_cache(SOURCE, LAYOUT, new_transfer_id(), [1], [3])
    sink.expect(aborted.transfer_id, [3], clock.now + 5)
    assert sink.abort(aborted.transfer_id) and not sink.abort(aborted.transfer_id)
    with pytest.raises(TransferError, match="aborted"):
        sink.deliver(wire(aborted))
    assert block_digests(sink.kv_caches, [3]) == [ZERO]
    assert sink.num_refused == 3


def test_late_message_is_refused_and_the_transfer_expires(sink, clock):
    message = message_from_cache(SOURCE, LAYOUT, new_transfer_id(), [1], [2])
    sink.expect(message.transfer_id, [2], clock.now + 1, tag="slow")
    clock.now += 2
    with pytest.raises(TransferError, match="deadline"):
        sink.deliver(wire(message))
    events = sink.take_events()
    assert [(e.tag, e.ok) for e in events] == [("slow", False)] and "deadline" in events[0].reason
    assert block_digests(sink.kv_caches, [2]) == [ZERO]
    assert sink.reserved_block_ids == set()


def test_expire_overdue_releases_reservations(sink, clock):
    sink.expect(new_transfer_id(), [1, 2], clock.now + 1, tag="a")
    sink.expect(new_transfer_id(), [3], clock.now + 10, tag="b")
    clock.now += 5
    sink.expire_overdue()
    assert sink.reserved_block_ids == {3}
    assert [e.tag for e in sink.take_events()] == ["a"]


def test_blocks_outside_the_reservation_are_refused(sink, clock):
    tid = new_transfer_id()
    sink.expect(tid, [4, 5], clock.now + 5)
    with pytest.raises(TransferError, match="not open"):
        sink.deliver(wire(message_from_cache(SOURCE, LAYOUT, tid, [1, 2], [4, 6])))
    with pytest.raises(WireError, match="outside the pool"):
        sink.deliver(wire(message_from_cache(SOURCE, LAYOUT, tid, [1], [LAYOUT.num_blocks])))
    assert block_digests(sink.kv_caches, [4, 5, 6]) == [ZERO] * 3
    assert tid in sink.pending_transfer_ids  # a refused message leaves the transfer open


def test_reservations_do_not_overlap(sink, clock):
    sink.expect(new_transfer_id(), [1, 2], clock.now + 5)
    with pytest.raises(TransferError, match="reserved by another"):
        sink.expect(new_transfer_id(), [2, 3], clock.now + 5)
    with pytest.raises(ValueError):
        sink.expect(new_transfer_id(), [4, 4], clock.now + 5)
    with pytest.raises(ValueError):
        sink.expect(new_transfer_id(), [LAYOUT.num_blocks], clock.now + 5)


def test_corrupt_and_incompatible_messages_are_refused(sink, clock):
    tid = new_transfer_id()
    sink.expect(tid, [2], clock.now + 5)
    good = wire(message_from_cache(SOURCE, LAYOUT, tid, [1], [2]))
    flipped = bytearray(good)
    flipped[-7] ^= 1
    with pytest.raises(WireError, match="checksum"):
        sink.deliver(bytes(flipped))
    with pytest.raises(WireError, match="truncated"):
        sink.deliver(good[:-1])
    other = tiny_layout(num_blocks=16, model_name="other")
    with pytest.raises(WireError, match="compatibility"):
        sink.deliver(wire(message_from_cache(make_caches(other, 1), other, tid, [1], [2])))
    assert block_digests(sink.kv_caches, [2]) == [ZERO]
    sink.deliver(good)  # the genuine message still lands
    assert sink.is_complete(tid)


def test_transport_path_check_staging_commit(sink, clock):
    """What a transport does: check the header + index, receive into staging, commit."""
    tid = new_transfer_id()
    sink.expect(tid, [10, 11], clock.now + 5)
    message = message_from_cache(SOURCE, LAYOUT, tid, [3, 4], [10, 11])
    header = parse_header(message.header, sink.limits)
    sink.check(header, message.index)
    staging = sink.staging(header)
    assert staging.numel() == header.payload_len
    staging.copy_(message.payload.view(-1).view(staging.dtype))
    sink.commit(header, message.index, staging)
    assert block_digests(sink.kv_caches, [10, 11]) == block_digests(SOURCE, [3, 4])


def test_abort_racing_commits_never_leaves_a_partial_write(clock):
    """After abort returns, no block of the transfer changes."""
    for round_ in range(20):
        sink = CacheSink(make_caches(LAYOUT), LAYOUT, clock=clock)
        tid = new_transfer_id()
        sink.expect(tid, list(range(1, 9)), clock.now + 5)
        data = wire(message_from_cache(SOURCE, LAYOUT, tid, list(range(1, 9)), list(range(1, 9))))
        thread = threading.Thread(target=lambda: _try(sink.deliver, data))
        thread.start()
        sink.abort(tid)
        after_abort = block_digests(sink.kv_caches, range(1, 9))
        thread.join(5)
        assert block_digests(sink.kv_caches, range(1, 9)) == after_abort
        assert after_abort in ([ZERO] * 8, block_digests(SOURCE, range(1, 9)))


def _try(fn, *args):
    try:
        fn(*args)
    except TransferError:
        pass


def test_close_aborts_everything_and_is_idempotent(sink, clock):
    sink.expect(new_transfer_id(), [1], clock.now + 5)
    sink.close()
    sink.close()
    assert sink.pending_transfer_ids == set() and sink.reserved_block_ids == set()


def test_blocks_under_other_hashes_than_reserved_are_refused(sink, clock):
    """Issue 25, item 3: a peer that fills a victim's reserved blocks with another prompt's KV
    (same length, other block hashes) is refused; the blocks stay untouched and open, and the
    right blocks still land."""
    tid = new_transfer_id()
    sink.expect(tid, [4, 5], clock.now + 5, tag="victim", block_keys=[111, 222])
    with pytest.raises(TransferError, match="block hashes other than the ones reserved"):
        sink.deliver(wire(message_from_cache(SOURCE, LAYOUT, tid, [1, 2], [4, 5], block_hashes=[111, 999])))
    assert block_digests(sink.kv_caches, [4, 5]) == [ZERO] * 2 and sink.num_refused == 1
    assert tid in sink.pending_transfer_ids
    sink.deliver(wire(message_from_cache(SOURCE, LAYOUT, tid, [1, 2], [4, 5], block_hashes=[111, 222])))
    assert sink.is_complete(tid) and sink.reserved_block_ids == set()


def test_a_digest_checksum_message_lands_and_its_corruption_is_refused(sink, clock):
    """FLAG_DEVICE_DIGEST (what a GPU payload carries, built here from host memory): the
    checksum covers the payload's digest, checked wherever the payload landed — host bytes
    or a staging tensor — and a flipped bit anywhere is refused."""
    from pdserve.kvtransfer.wire import FLAG_DEVICE_DIGEST

    tid = new_transfer_id()
    sink.expect(tid, [2, 5, 6], clock.now + 5)
    message = message_from_cache(SOURCE, LAYOUT, tid, [1, 3], [2, 5], digest=True)
    assert message.header[7] == FLAG_DEVICE_DIGEST
    header = parse_header(message.header, sink.limits)
    assert header.device_digest
    good = wire(message)
    for position in (-1, -message.payload_nbytes // 2 - 1, -message.payload_nbytes):  # last, middle, first byte
        flipped = bytearray(good)
        flipped[position] ^= 0x10
        with pytest.raises(WireError, match="checksum"):
            sink.deliver(bytes(flipped))
    assert block_digests(sink.kv_caches, [2, 5]) == [ZERO, ZERO]
    sink.deliver(good)
    assert block_digests(sink.kv_caches, [2, 5]) == block_digests(SOURCE, [1, 3])
    staged = message_from_cache(SOURCE, LAYOUT, tid, [4], [6], digest=True)  # the transport path
    header = parse_header(staged.header, sink.limits)
    sink.check(header, staged.index)
    staging = sink.staging(header, on_device=True)  # a host cache: host staging all the same
    assert staging.device.type == "cpu"
    staging.copy_(staged.payload.view(-1).view(staging.dtype))
    sink.commit(header, staged.index, staging)
    assert sink.is_complete(tid) and block_digests(sink.kv_caches, [6]) == block_digests(SOURCE, [4])
