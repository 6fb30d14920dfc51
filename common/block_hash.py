"""Block keys and stable hashes: part of the protocol, shared by router and workers.

A prompt's full blocks are named by a chain of keyed BLAKE2b digests (DESIGN §7: no client
may steer two prompts into one key):

    root    = BLAKE2b_key(encode("pdserve-blocks-v2", salt, cache_salt))
    d[i]    = BLAKE2b_key(d[i-1] || block i's token ids as little-endian int64)
    hash[i] = the top KEY_BITS bits of d[i]'s first 8 bytes (an int64 for protos, >= 0)

`key` is derived from the cluster secret (`security.secret.block_hash_key`); without one (loopback only, or
--insecure-internal) it is the fixed, public `INSECURE_KEY`, and the digests are then as
strong as unkeyed BLAKE2b: collision-resistant, but anyone can compute them. `salt` is
the model's compatibility hash; `cache_salt` is the request's tenant salt (vLLM's field): it
enters the root, so prompts with different salts share no block. `lora_key` (a LoRA
adapter's digest, "" for the base model) enters it too when set: KV computed under one
adapter is never found under another or under the base model.

`hash[i]` is a lookup key, short by design; `d[i]` (32 bytes) is what a cache or store
hit is checked against before its KV is used: equal digests mean equal prompt prefixes.

Imports neither torch nor grpc, so the router can use it.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Iterable

import xxhash

from pdserve.common.util import encode_fields
from pdserve.common.errors import InvalidRequestError

# Without a cluster secret every service uses this key (public: it is in the source).
INSECURE_KEY = b"pdserve-v1/block-hash/no-cluster-secret"
DIGEST_BYTES = 32
# Bits of a digest kept in a block's key. A test hook: a test may lower it (e.g. to 12) to
# find colliding keys in seconds and show the digest check refuses the colliding block.
KEY_BITS = 63
MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(cache_salt: str) -> str:
    """A request's `cache_salt`, bounded (InvalidRequestError naming the field otherwise)."""
    if not isinstance(cache_salt, str):
        raise InvalidRequestError("'cache_salt' must be a string", param="cache_salt")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(f"'cache_salt' is {len(cache_salt)} characters; at most "
                                  f"{MAX_CACHE_SALT_CHARS} are allowed", param="cache_salt")
    return cache_salt


def stable_hash64(*parts: object) -> int:
    """xxh64 over the repr-free encoding of ints, strs and bytes; the same on every host.
    Not collision-resistant: for ids and layouts, never for content a client chooses."""
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


def key_of(digest: bytes) -> int:
    """A block's lookup key: the top KEY_BITS bits of its digest's first 8 bytes."""
    return int.from_bytes(digest[:8], "big") >> (64 - KEY_BITS)


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """The keys and digests of a prompt's full blocks (a partial last block has none)."""

    hashes: list[int]
    digests: list[bytes]


def chain_root(salt: int, key: bytes = INSECURE_KEY, cache_salt: str = "", lora_key: str = "") -> bytes:
    """The digest every chain of this model, key, tenant salt and adapter starts from."""
    fields: tuple = ("pdserve-blocks-v2", int(salt), cache_salt)
    if lora_key:  # the base model's keys stay what they were
        fields += ("lora", lora_key)
    return hashlib.blake2b(encode_fields(*fields), key=key, digest_size=DIGEST_BYTES).digest()


def chain_blocks(parent: bytes, token_ids: Iterable[int], block_size: int,
                 key: bytes = INSECURE_KEY) -> PromptBlocks:
    """The keys and digests of the full blocks of `token_ids`, chained after `parent` (the
    digest of the block before them, or `chain_root`). A prompt's blocks and the blocks a
    decode generates after it chain the same way, so a later prompt that repeats both finds
    them under the same keys."""
    ids = list(token_ids)
    hashes: list[int] = []
    digests: list[bytes] = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, key=key, digest_size=DIGEST_BYTES)
        h.update(struct.pack(f"<{block_size}q", *ids[start:start + block_size]))
        parent = h.digest()
        digests.append(parent)
        hashes.append(key_of(parent))
    return PromptBlocks(hashes, digests)


def prompt_blocks(token_ids: Iterable[int], block_size: int, salt: int, key: bytes = INSECURE_KEY,
                  cache_salt: str = "", lora_key: str = "") -> PromptBlocks:
    """The chained keys and digests of every full block of `token_ids`."""
    return chain_blocks(chain_root(salt, key, cache_salt, lora_key), token_ids, block_size, key)


def hash_prompt_blocks(token_ids: Iterable[int], block_size: int, salt: int, key: bytes = INSECURE_KEY,
                       cache_salt: str = "", lora_key: str = "") -> list[int]:
    """The keys alone of `prompt_blocks` (what routing compares)."""
    return prompt_blocks(token_ids, block_size, salt, key, cache_salt, lora_key).hashes


def prompt_digest(token_ids: Iterable[int]) -> bytes:
    """SHA-256 of a whole prompt's token ids (what a hand-off's signature binds)."""
    ids = list(token_ids)
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).digest()


def hashes_digest(hashes: Iterable[int]) -> bytes:
    """SHA-256 of a list of block keys (what a hand-off's signature binds)."""
    values = list(hashes)
    return hashlib.sha256(struct.pack(f"<{len(values)}q", *values)).digest()
