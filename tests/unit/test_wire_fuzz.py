"""The wire parser under hostile input: random, truncated, oversized and mutated headers,
indices and payloads. Every refusal is a WireError; nothing is allocated from peer sizes."""
from __future__ import annotations

import random
import struct
import time
import tracemalloc
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.errors import TransferError
from pdserve.kvtransfer.codec import decode_message, decode_record, new_transfer_id, split_records
from pdserve.kvtransfer.sink import CacheSink, limits_for
from kvcaches import make_caches, message_from_cache, tiny_layout
from pdserve.kvtransfer.wire import (
    FORMAT_VERSION, HEADER, HEADER_SIZE, INDEX_ENTRY, MAGIC, WireError, parse_header, parse_index,
)

LAYOUT = tiny_layout(num_blocks=16, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
LIMITS = limits_for(LAYOUT)
SOURCE = make_caches(LAYOUT, seed=3)
FUZZ = settings(max_examples=400, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def good_message(num_blocks: int = 3):
    src = list(range(1, num_blocks + 1))
    dst = list(range(8, 8 + num_blocks))
    msg = message_from_cache(SOURCE, LAYOUT, new_transfer_id(), src, dst, [11 * i for i in src])
    payload = bytes(msg.payload.numpy().tobytes())
    return msg, msg.header + msg.index + payload


def header_with(**fields) -> bytes:
    """A header with chosen fields and a *valid* header CRC, so the deeper checks run."""
    values = dict(magic=MAGIC, version=FORMAT_VERSION, dtype=0, flags=0,
                  compat=LIMITS.compat_hash, transfer_id=bytes(16), num_blocks=1,
                  num_layers=LIMITS.num_layers, block_size=LIMITS.block_size,
                  num_kv_heads=LIMITS.num_kv_heads, head_dim=LIMITS.head_dim,
                  first_layer=0, layer_count=LIMITS.num_layers, reserved=0,
                  payload_len=0, checksum=0)
    values.update(fields)
    body = HEADER.pack(*values.values(), 0)[:HEADER_SIZE - 4]
    return body + struct.pack("<I", zlib.crc32(body))


def parse_or_refuse(data: bytes):
    try:
        header = parse_header(data, LIMITS)
    except WireError:
        return None
    # whatever got through agrees with the receiver's limits
    assert 0 < header.num_blocks <= LIMITS.max_blocks
    assert header.payload_len == header.num_blocks * header.block_nbytes
    return header


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_are_refused(data):
    assert parse_or_refuse(data) is None or data[:4] == MAGIC
    with pytest.raises(WireError):
        decode_message(data, LIMITS, LAYOUT.num_blocks)


u8, u16, u32, u64 = (st.integers(0, 2**n - 1) for n in (8, 16, 32, 64))
i64 = st.integers(-2**63, 2**63 - 1)


@FUZZ
@given(version=u16, dtype=u8, flags=u8, compat=i64, num_blocks=u32, num_layers=u16,
       block_size=u16, heads=u16, head_dim=u16, payload_len=u64)
def test_mutated_headers_pass_only_when_consistent(version, dtype, flags, compat, num_blocks,
                                                   num_layers, block_size, heads, head_dim,
                                                   payload_len):
    data = header_with(version=version, dtype=dtype, flags=flags, compat=compat,
                       num_blocks=num_blocks, num_layers=num_layers, block_size=block_size,
                       num_kv_heads=heads, head_dim=head_dim, payload_len=payload_len)
    parse_or_refuse(data)


@FUZZ
@given(first_layer=u16, layer_count=u16, reserved=u32, num_blocks=st.integers(0, 20), payload_len=u64)
def test_layer_slices_pass_only_inside_the_model(first_layer, layer_count, reserved, num_blocks, payload_len):
    header = parse_or_refuse(header_with(first_layer=first_layer, layer_count=layer_count,
                                         reserved=reserved, num_blocks=num_blocks, payload_len=payload_len))
    if header is not None:
        assert reserved == 0 and 0 < layer_count and first_layer + layer_count <= LIMITS.num_layers
        assert list(header.layers) == list(range(first_layer, first_layer + layer_count))


@FUZZ
@given(num_blocks=u32, payload_len=u64)
def test_sizes_near_the_limits(num_blocks, payload_len):
    """Shape right, sizes hostile: only exact, in-range sizes pass."""
    header = parse_or_refuse(header_with(num_blocks=num_blocks, payload_len=payload_len))
    if header is not None:
        assert header.payload_len == payload_len


def test_oversized_claims_are_refused_before_any_allocation():
    hostile = [header_with(num_blocks=2**32 - 1, payload_len=2**64 - 1),
               header_with(num_blocks=LIMITS.max_blocks + 1,
                           payload_len=(LIMITS.max_blocks + 1) * 1024),
               header_with(num_blocks=1, payload_len=2**62),
               header_with(num_layers=65535, num_blocks=1, payload_len=2**40)]
    tracemalloc.start()
    try:
        for data in hostile:
            with pytest.raises(WireError):
                parse_header(data, LIMITS)
            with pytest.raises(WireError):
                decode_message(data + b"\0" * 64, LIMITS, LAYOUT.num_blocks)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, f"refusing hostile headers allocated {peak} bytes"


def test_sink_refuses_oversized_claims_without_staging():
    sink = CacheSink(make_caches(LAYOUT), LAYOUT)
    tracemalloc.start()
    try:
        with pytest.raises(WireError):
            sink.deliver(header_with(num_blocks=2**32 - 1, payload_len=2**64 - 1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_every_truncation_and_extension_is_refused():
    _, data = good_message()
    decode_message(data, LIMITS, LAYOUT.num_blocks)  # the intact one passes
    for cut in range(len(data)):
        with pytest.raises(WireError):
            decode_message(data[:cut], LIMITS, LAYOUT.num_blocks)
    for extra in (1, 16, 4096):
        with pytest.raises(WireError):
            decode_message(data + b"\0" * extra, LIMITS, LAYOUT.num_blocks)


def test_seeded_byte_flips_anywhere_are_refused():
    """A flipped byte in header, index or payload is always caught (CRC / checksum / checks)."""
    _, data = good_message()
    rng = random.Random(1234)
    start = time.monotonic()
    for _ in range(3000):
        mutated = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 8))):
            mutated[rng.randrange(len(mutated))] ^= rng.randrange(1, 256)
        if bytes(mutated) == data:
            continue
        with pytest.raises(WireError):
            decode_message(bytes(mutated), LIMITS, LAYOUT.num_blocks)
    assert time.monotonic() - start < 20


@FUZZ
@given(entries=st.lists(st.tuples(u32, u32, i64), min_size=1, max_size=20))
def test_fuzzed_index_entries(entries):
    header = parse_header(header_with(num_blocks=len(entries),
                                      payload_len=len(entries) * LIMITS.num_layers * 2 * 4 * 2 * 8 * 4),
                          LIMITS) if len(entries) <= LIMITS.max_blocks else None
    if header is None:
        return
    index = b"".join(INDEX_ENTRY.pack(*e) for e in entries)
    try:
        block_ids, hashes = parse_index(header, index, LAYOUT.num_blocks)
    except WireError:
        return
    assert all(0 <= b < LAYOUT.num_blocks for b in block_ids)
    assert len(set(block_ids)) == len(block_ids)
    with pytest.raises(WireError):
        parse_index(header, index[:-1], LAYOUT.num_blocks)


@FUZZ
@given(data=st.binary(max_size=300), key=i64)
def test_store_records_fuzz(data, key):
    with pytest.raises(WireError):
        decode_record(data, LIMITS, key)


def test_store_record_under_the_wrong_key_is_refused():
    msg, _ = good_message(2)
    records = split_records(msg, [5, 6])
    assert bytes(decode_record(records[0], LIMITS, 5))
    with pytest.raises(WireError, match="not"):
        decode_record(records[0], LIMITS, 6)


def test_sink_errors_are_typed():
    """Through the sink, every refusal is a TransferError (WireError is one)."""
    sink = CacheSink(make_caches(LAYOUT), LAYOUT)
    msg, data = good_message()
    rng = random.Random(7)
    for _ in range(500):
        cut = rng.randrange(len(data) + 50)
        blob = (data + bytes(50))[:cut]
        with pytest.raises(TransferError):
            sink.deliver(blob)  # unknown transfer id, or malformed
    assert sink.pending_transfer_ids == set()
