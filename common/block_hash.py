"""Stable block and compatibility hashes: part of the protocol, shared by router and workers.

Imports neither torch nor grpc, so the router can use it.
"""
from __future__ import annotations

import struct
from typing import Iterable

import xxhash


def stable_hash64(*parts: object) -> int:
    """xxh64 over the repr-free encoding of ints, strs and bytes; the same on every host."""
    h = xxhash.xxh64()
    for part in parts:
        if isinstance(part, bool) or isinstance(part, int):
            h.update(b"i" + struct.pack("<q", int(part)))
        elif isinstance(part, str):
            data = part.encode()
            h.update(b"s" + struct.pack("<I", len(data)) + data)
        elif isinstance(part, (bytes, bytearray, memoryview)):
            h.update(b"b" + struct.pack("<I", len(part)) + bytes(part))
        else:
            raise TypeError(f"cannot hash {type(part).__name__}")
    return h.intdigest() & 0x7FFF_FFFF_FFFF_FFFF  # fits a signed int64 / proto int64


def hash_block_tokens(parent_hash: int, token_ids: Iterable[int], salt: int) -> int:
    """Hash of one full block: its parent's hash, its token ids and the model's salt
    (compatibility hash). Equal hashes mean equal KV on any worker with the same model."""
    ids = list(token_ids)
    return stable_hash64(salt, parent_hash, struct.pack(f"<{len(ids)}q", *ids))


def hash_prompt_blocks(token_ids: Iterable[int], block_size: int, salt: int) -> list[int]:
    """Chained hashes of every full block of `token_ids` (a partial last block has none)."""
    ids = list(token_ids)
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, ids[start:start + block_size], salt)
        hashes.append(parent)
    return hashes
