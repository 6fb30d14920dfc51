"""Store records: the KV blocks the Redis and disk stores keep, keyed by block hash.

Threat: a record planted in the store (by anyone who can write to Redis or the store's
volume), or copied there from another deployment, served as a prompt's cached KV; or a
record moved under another block's key.

Rule: with the deployment's `store` key every record ends with a MAC over its block key and
every byte before it (`seal`); a reader checks it before it trusts anything in the record
(`open_sealed`), and a record failing it is refused and dropped. Without a key (loopback
only, or --insecure-internal) records carry no MAC and only their checksums catch damage.
The record's layout (header, index, payload, digest) and the stores that keep it are
adapters in `pdserve.kvtransfer`.
"""
from __future__ import annotations

import hmac

from pdserve.security.secret import Mac

RECORD_MAC_BYTES = 32  # HMAC-SHA256 trailer of a store record when the store has a key


def _tag(store_key: bytes, block_key: int, body: bytes | memoryview) -> bytes:
    return Mac(store_key).tag(int(block_key), bytes(body))


def seal(store_key: bytes | None, block_key: int, record: bytes) -> bytes:
    """`record` as a store keeps it under `block_key`: with its MAC trailer when the store
    has a key, unchanged without."""
    return record + _tag(store_key, block_key, record) if store_key else record


def open_sealed(store_key: bytes, block_key: int, sealed: bytes | memoryview) -> memoryview | None:
    """The record inside `sealed`, read under `block_key`; None when its MAC fails (planted,
    altered, moved from another key or from another deployment)."""
    view = memoryview(sealed)
    body, tag = view[:-RECORD_MAC_BYTES], view[-RECORD_MAC_BYTES:]
    if len(view) < RECORD_MAC_BYTES or not hmac.compare_digest(bytes(tag), _tag(store_key, block_key, body)):
        return None
    return body


def sealed_overhead(keyed: bool) -> int:
    """Bytes a sealed record adds to the record (its MAC when `keyed`)."""
    return RECORD_MAC_BYTES if keyed else 0
