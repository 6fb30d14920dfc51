"""Store records: the KV blocks the Redis and disk stores keep, keyed by block hash.

Threat: a record planted in the store (by anyone who can write to Redis or the store's
volume), or copied there from another deployment, served as a prompt's cached KV; a record
moved under another block's key; or the records read (a copy of the volume, a Redis
replica, a backup): layer 0's K/V is a function of the token alone, so one record gives
back its prompt's text.

Rule: with the deployment's `store` key every record is sealed with an AEAD
(ChaCha20-Poly1305, a random 96-bit nonce per record, the block key as associated data)
under a key derived from it (`seal`): what a store keeps is the nonce, the ciphertext and
the tag, no byte of the record in clear. A reader opens it (`open_sealed`) before it
trusts anything in it, and a record failing its tag is refused and dropped. Without a key
(loopback only, or --insecure-internal) records are kept in clear, without a tag, and only
their checksums catch damage. The record's layout (header, index, payload, digest) and the
stores that keep it are adapters in `pdserve.kvtransfer`.
"""
from __future__ import annotations

import os
from functools import lru_cache

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from pdserve.common.util import encode_fields
from pdserve.security.secret import derive_key

NONCE_BYTES = 12
TAG_BYTES = 16
RECORD_SEAL_BYTES = NONCE_BYTES + TAG_BYTES  # what a sealed record adds to the record
_LABEL = b"pdserve-store-record-aead-v1"


@lru_cache(maxsize=8)
def _cipher(store_key: bytes) -> ChaCha20Poly1305:
    return ChaCha20Poly1305(derive_key(store_key, _LABEL))


def _associated(block_key: int) -> bytes:
    return encode_fields("pdserve-store-record", int(block_key))


def seal(store_key: bytes | None, block_key: int, record: bytes) -> bytes:
    """`record` as a store keeps it under `block_key`: encrypted and tagged when the store
    has a key (nonce || ciphertext || tag), unchanged without."""
    if not store_key:
        return record
    nonce = os.urandom(NONCE_BYTES)
    return nonce + _cipher(store_key).encrypt(nonce, bytes(record), _associated(block_key))


def open_sealed(store_key: bytes, block_key: int, sealed: bytes | memoryview) -> memoryview | None:
    """The record inside `sealed`, read under `block_key`; None when its tag fails (planted,
    altered, moved from another key or from another deployment)."""
    view = memoryview(sealed)
    if len(view) < RECORD_SEAL_BYTES:
        return None
    try:
        record = _cipher(store_key).decrypt(bytes(view[:NONCE_BYTES]), bytes(view[NONCE_BYTES:]),
                                            _associated(block_key))
    except InvalidTag:
        return None
    return memoryview(record)


def sealed_overhead(keyed: bool) -> int:
    """Bytes a sealed record adds to the record (nonce and tag when `keyed`)."""
    return RECORD_SEAL_BYTES if keyed else 0
