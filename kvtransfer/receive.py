"""The receiving half of a store transfer: fetch the blocks a verdict names, commit them
through the sink's checks (pending transfer id, reserved blocks, deadline, checksum)."""
from __future__ import annotations

from typing import Sequence

from pdserve.common.errors import TransferError
from pdserve.kvtransfer.base import BlockStore
from pdserve.kvtransfer.codec import encode_message
from pdserve.kvtransfer.sink import CacheSink
from pdserve.kvtransfer.wire import parse_header


def land_from_store(store: BlockStore, sink: CacheSink, transfer_id: bytes,
                    dst_block_ids: Sequence[int], keys: Sequence[int]) -> int:
    """Fetch block i under keys[i] into dst_block_ids[i]. Returns payload bytes landed.
    Raises TransferError if any block is missing or the sink refuses them."""
    if len(keys) != len(dst_block_ids):
        raise TransferError(f"{len(keys)} store keys for {len(dst_block_ids)} destination blocks")
    payloads = store.get(keys, sink.limits)
    missing = sum(1 for p in payloads if p is None)
    if missing:
        raise TransferError(f"{store.name} store is missing {missing} of {len(keys)} blocks")
    message = encode_message(sink.limits, transfer_id, dst_block_ids, keys, b"".join(payloads))
    header = parse_header(message.header, sink.limits)
    sink.check(header, message.index)
    sink.commit(header, message.index, message.payload)
    short_lived = [k for k in keys if k < 0]
    if short_lived:
        store.discard(short_lived, sink.limits.compat_hash)
    return header.payload_len
