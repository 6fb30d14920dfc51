"""Store records are authenticated with the deployment's store key: on a real Redis server and
a real directory, a record planted by whoever can write the store (no key, another
deployment's key, a valid record copied under another block's key) is a miss, counted and
deleted, never loaded."""
from __future__ import annotations

import os

import pytest

from pdserve.kvtransfer.backends.disk import DiskStore
from pdserve.kvtransfer.codec import encode_message
from pdserve.kvtransfer.sink import limits_for
from kvcaches import tiny_layout
from pdserve.kvtransfer.wire import payload_nbytes

LAYOUT = tiny_layout(num_blocks=16)
LIMITS = limits_for(LAYOUT)
BLOCK_NBYTES = payload_nbytes(1, LAYOUT.num_layers, LAYOUT.block_size, LAYOUT.num_kv_heads,
                              LAYOUT.head_dim, LAYOUT.dtype)
OURS, THEIRS = os.urandom(32), os.urandom(32)


def message(keys, fill: int):
    payload = bytes([fill]) * (BLOCK_NBYTES * len(keys))
    return encode_message(LIMITS, bytes(16), [0] * len(keys), keys, payload)


@pytest.fixture(params=["redis", "disk"])
def make_store(request, tmp_path):
    if request.param == "disk":
        yield lambda key: DiskStore(tmp_path / "kv", mac_key=key)
        return
    from pdserve.kvtransfer.backends.redis import RedisStore

    server = request.getfixturevalue("redis_server")
    made = []

    def make(key):
        made.append(RedisStore(server.url, mac_key=key))
        return made[-1]

    yield make
    for store in made:
        store.close()


def test_only_records_written_with_our_key_are_loaded(make_store):
    ours, anonymous, other_deployment = make_store(OURS), make_store(None), make_store(THEIRS)
    assert ours.put([101, 102], message([101, 102], fill=7)) == 2
    assert [bytes(v) for v in ours.get([101, 102], LIMITS)] == [bytes([7]) * BLOCK_NBYTES] * 2
    # whoever can write the store plants blocks for prompts others will send
    anonymous.put([201], message([201], fill=66))
    other_deployment.put([202], message([202], fill=67))
    assert ours.get([201, 202], LIMITS) == [None, None]
    assert ours.num_unauthenticated == 2
    assert anonymous.get([201, 202], LIMITS) == [None, None]  # refused records are deleted
    # a valid record copied under another block's key is refused as well
    valid = ours.get([101], LIMITS)[0]
    assert valid is not None
    ours.put([301], message([301], fill=8))
    if isinstance(ours, DiskStore):
        src, dst = ours.path_of(LIMITS.compat_hash, 101), ours.path_of(LIMITS.compat_hash, 301)
        dst.write_bytes(src.read_bytes())
    else:
        from pdserve.kvtransfer.backends.redis import redis_key

        client = ours._client
        client.set(redis_key(LIMITS.compat_hash, 301), client.get(redis_key(LIMITS.compat_hash, 101)))
    assert ours.get([301], LIMITS) == [None] and ours.num_unauthenticated == 3


def _layer0_bytes(fill_seed: int) -> bytes:
    """A block payload whose every 16-byte window is distinct (a layer's K/V, as a stand-in)."""
    import hashlib

    out, counter = bytearray(), 0
    while len(out) < BLOCK_NBYTES:
        out += hashlib.sha256(f"{fill_seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:BLOCK_NBYTES])


def test_the_disk_stores_files_hold_no_kv_bytes_in_clear_and_a_tampered_record_is_a_miss(tmp_path):
    store = DiskStore(tmp_path / "kv", mac_key=OURS)
    payload = _layer0_bytes(1)
    assert store.put([401], encode_message(LIMITS, bytes(16), [0], [401], payload)) == 1
    on_disk = b"".join(path.read_bytes() for path in (tmp_path / "kv").rglob("*") if path.is_file())
    layer0 = payload[:LAYOUT.block_size * LAYOUT.num_kv_heads * LAYOUT.head_dim * 2]  # layer 0's K, in part
    assert on_disk and all(layer0[i:i + 16] not in on_disk for i in range(0, len(layer0) - 16, 16))
    assert bytes(store.get([401], LIMITS)[0]) == payload  # opened again, whole
    path = store.path_of(LIMITS.compat_hash, 401)
    sealed = bytearray(path.read_bytes())
    sealed[len(sealed) // 2] ^= 1  # one bit of the ciphertext
    path.write_bytes(bytes(sealed))
    assert store.get([401], LIMITS) == [None] and store.num_unauthenticated == 1
    clear = DiskStore(tmp_path / "clear", mac_key=None)  # without a secret: kept in clear (loopback only)
    clear.put([402], encode_message(LIMITS, bytes(16), [0], [402], payload))
    assert layer0[:16] in clear.path_of(LIMITS.compat_hash, 402).read_bytes()
