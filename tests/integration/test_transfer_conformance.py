"""Conformance of every KV transfer backend, between two OS processes.

This process is the sender (its cache is filled with seeded values); a child process
(`transfer_peer.py`, spawned fresh, JSON lines over pipes, nothing pickled) is the receiver
with its own zeroed cache behind a CacheSink. For each backend:

* blocks sent from one cache arrive bit-identical in the other's;
* a flipped payload byte, a truncated payload, a wrong compatibility hash and a duplicate
  transfer id are each refused, and the destination blocks stay untouched;
* a receiver whose transfer never comes releases it at the deadline; a peer that never
  answers makes the sender hit its deadline;
* close is idempotent; and no block is left reserved on the receiving side after any case.

Point-to-point backends (ucx, nccl, and tcp: the link protocol over a plain socket) deliver straight into the receiver's blocks. Stores
(redis, disk) are exercised as the chain uses them: the sender puts, the receiver fetches and
commits through its sink.
"""
from __future__ import annotations

import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.lab.child import Child
from pdserve.common.block_hash import DIGEST_BYTES
from pdserve.common.errors import TransferError
from pdserve.kvtransfer import backend_loader
from pdserve.kvtransfer.base import BlockMessage
from pdserve.kvtransfer.codec import as_bytes_view, new_transfer_id, split_records
from pdserve.kvtransfer.config import STORES, KVTransferConfig
from kvcaches import block_digests, make_caches, message_from_cache, tiny_layout

PEER = Path(__file__).with_name("transfer_peer.py")
LAYOUT_ARGS = dict(num_blocks=64, num_layers=4, block_size=16, num_kv_heads=2, head_dim=64)
LAYOUT = tiny_layout(**LAYOUT_ARGS)  # one block across layers = 64 KiB
DEADLINE_S = 5.0
SLACK_S = 5.0  # a deadline may be overshot by this much on a loaded 2-core CI box


def _backend_params():
    params = []
    for name in ("ucx", "nccl"):
        ok, why = backend_loader.is_importable(name)
        params.append(pytest.param(name, marks=pytest.mark.skipif(
            not ok, reason=f"{name} transport not available yet: {why}")))
    return params + ["tcp", "redis", "disk"]


def open_transport(name: str, config: KVTransferConfig):
    """A registered transport, or `tcp`: the link protocol over a plain socket channel, written
    against the channel contract alone (not a deployment's transport, so not registered)."""
    if name == "tcp":
        from pdserve.kvtransfer.backends import tcp

        return tcp.create_transport(config)
    return backend_loader.open_transport(name, config)


class PeerProcess(Child):
    """The receiving child process; every call has a deadline."""

    def __init__(self, log_path: Path) -> None:
        super().__init__([sys.executable, str(PEER)], log_path, timeout_s=30.0)

    def ok(self, cmd: str, timeout_s: float | None = None, **args) -> dict:
        reply = self.call(cmd, timeout_s, **args)
        assert reply["ok"], f"{cmd}: {reply.get('error')}\n{reply.get('trace', '')}"
        return reply


@dataclass
class Link:
    """Sender-side backend + the receiving peer."""

    name: str
    peer: PeerProcess
    backend: object  # KVTransport or BlockStore
    endpoint: str
    config: KVTransferConfig
    source: list

    @property
    def is_store(self) -> bool:
        return self.name in STORES

    def message(self, src, dst, layout=LAYOUT, transfer_id=None, keys=None) -> BlockMessage:
        caches = self.source if layout is LAYOUT else make_caches(layout, seed=7)
        return message_from_cache(caches, layout, transfer_id or new_transfer_id(), src, dst, keys)

    def expect(self, message: BlockMessage, dst, within_s: float = 30.0, keys=None) -> None:
        """Reserve `dst` for `message`'s transfer; with `keys`, block i only under keys[i]."""
        self.peer.ok("expect", transfer_id=message.transfer_id.hex(), blocks=list(dst),
                     within_s=within_s, keys=None if keys is None else list(keys))

    def deliver(self, message: BlockMessage, dst, keys) -> None:
        """Carry `message` to the peer; raises TransferError/TimeoutError/ValueError if refused."""
        if not self.is_store:
            self.backend.send(self.endpoint, message, time.monotonic() + DEADLINE_S)
            return
        self.put(message, keys)
        self.fetch(message.transfer_id, dst, keys)

    def put(self, message: BlockMessage, keys) -> None:
        assert self.backend.put(keys, message) == len(keys)

    def fetch(self, transfer_id: bytes, dst, keys) -> None:
        reply = self.peer.call("fetch", transfer_id=transfer_id.hex(), blocks=list(dst), keys=list(keys))
        if not reply["ok"]:
            raise TransferError(reply["error"])

    def digests(self, blocks) -> list[str]:
        return self.peer.ok("digests", blocks=list(blocks))["digests"]

    def assert_nothing_reserved(self) -> None:
        state = self.peer.ok("state")
        assert state["pending"] == [] and state["reserved"] == [], state


@pytest.fixture(scope="module", params=_backend_params())
def link(request, tmp_path_factory):
    name = request.param
    settings: dict = {}
    if name == "redis":
        settings["redis_url"] = request.getfixturevalue("redis_server_session").url
    elif name == "disk":
        settings["disk_store"] = str(tmp_path_factory.mktemp("disk-store"))
    config = KVTransferConfig(**settings)
    peer = PeerProcess(tmp_path_factory.mktemp(f"peer-{name}") / "peer.log")
    try:
        endpoint = peer.ok("init", timeout_s=120, backend=name, layout=LAYOUT_ARGS,
                           config=settings)["endpoint"]
        backend = (backend_loader.open_store(name, config) if name in STORES
                   else open_transport(name, config))
    except BaseException:
        peer.stop()
        raise
    yield Link(name, peer, backend, endpoint, config, make_caches(LAYOUT, seed=7))
    backend.close()
    peer.stop()


_keys = iter(range(1, 1 << 40))


def fresh_keys(n: int) -> list[int]:
    """Store keys no earlier case used (content hashes are non-negative; the last one of a
    prompt may be a negative short-lived key — exercise both)."""
    keys = [next(_keys) * 7919 for _ in range(n)]
    keys[-1] = -keys[-1]
    return keys


def corrupt_record(link: Link, key: int, edit) -> None:
    """Rewrite the stored record of `key` with `edit(bytes) -> bytes`."""
    compat = LAYOUT.compatibility_hash()
    if link.name == "disk":
        path = link.backend.path_of(compat, key)
        path.write_bytes(edit(path.read_bytes()))
    else:
        from pdserve.kvtransfer.backends.redis import redis_key

        client = link.backend._client
        name = redis_key(compat, key)
        client.set(name, edit(client.get(name)))


def record_exists(link: Link, key: int) -> bool:
    compat = LAYOUT.compatibility_hash()
    if link.name == "disk":
        return link.backend.path_of(compat, key).exists()
    from pdserve.kvtransfer.backends.redis import redis_key

    return bool(link.backend._client.exists(redis_key(compat, key)))


def flip_byte(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0xFF
    return bytes(out)


# -- the cases ------------------------------------------------------------------------------
def test_blocks_arrive_bit_identical(link):
    src, dst = [3, 9, 10, 11, 40], [20, 5, 6, 63, 1]
    message = link.message(src, dst)
    keys = fresh_keys(len(src))
    link.expect(message, dst)
    assert set(link.digests(dst)) == set(block_digests(make_caches(LAYOUT), [0]))  # zeros
    link.deliver(message, dst, keys)
    assert link.digests(dst) == block_digests(link.source, src)
    link.assert_nothing_reserved()


def test_flipped_byte_is_refused(link):
    src, dst = [1, 2, 3], [30, 31, 32]
    message = link.message(src, dst)
    keys = fresh_keys(len(src))
    before = link.digests(dst)
    link.expect(message, dst)
    if link.is_store:
        link.put(message, keys)
        # a payload byte: the record ends with the block's digest (and a MAC when keyed)
        corrupt_record(link, keys[1], lambda rec: flip_byte(rec, len(rec) - 5 - DIGEST_BYTES))
        with pytest.raises(TransferError, match="missing 1 of 3"):
            link.fetch(message.transfer_id, dst, keys)
        assert not record_exists(link, keys[1])  # a corrupt record is deleted
    else:
        payload = flip_byte(bytes(as_bytes_view(message.payload)), 1234)
        with pytest.raises((TransferError, TimeoutError)):
            link.deliver(BlockMessage(message.transfer_id, message.header, message.index, payload),
                         dst, keys)
    assert link.digests(dst) == before
    assert link.peer.ok("abort", transfer_id=message.transfer_id.hex())["aborted"]
    link.assert_nothing_reserved()


def test_blocks_under_other_hashes_than_reserved_are_refused(link):
    """Issue 25, item 3: the receiver reserved each block for its hash; blocks of another
    prompt of the same length (other hashes) are refused and leave the blocks untouched; the
    right ones still land."""
    src, dst = [9, 10], [42, 43]
    reserved, other = fresh_keys(2), fresh_keys(2)
    swapped = link.message(src, dst, keys=other)
    before = link.digests(dst)
    link.expect(swapped, dst, keys=reserved)
    with pytest.raises((TransferError, TimeoutError), match="other than the ones reserved|timed out|deadline"):
        link.deliver(swapped, dst, other)
    assert link.digests(dst) == before
    right = link.message(src, dst, transfer_id=swapped.transfer_id, keys=reserved)
    link.deliver(right, dst, reserved)
    assert link.digests(dst) == block_digests(link.source, src)
    link.assert_nothing_reserved()


def test_truncated_payload_is_refused(link):
    src, dst = [4, 5], [33, 34]
    message = link.message(src, dst)
    keys = fresh_keys(len(src))
    before = link.digests(dst)
    link.expect(message, dst)
    if link.is_store:
        link.put(message, keys)
        corrupt_record(link, keys[0], lambda rec: rec[:-100])
        with pytest.raises(TransferError, match="missing 1 of 2"):
            link.fetch(message.transfer_id, dst, keys)
    else:
        short = bytes(as_bytes_view(message.payload))[:-100]
        with pytest.raises((TransferError, TimeoutError, ValueError)):
            link.deliver(BlockMessage(message.transfer_id, message.header, message.index, short),
                         dst, keys)
    assert link.digests(dst) == before
    link.peer.ok("abort", transfer_id=message.transfer_id.hex())
    link.assert_nothing_reserved()


def test_wrong_compatibility_hash_is_refused(link):
    other = tiny_layout(**LAYOUT_ARGS, model_name="another-model")
    assert other.compatibility_hash() != LAYOUT.compatibility_hash()
    src, dst = [6, 7], [35, 36]
    keys = fresh_keys(len(src))
    message = link.message(src, dst, layout=other, keys=keys)
    before = link.digests(dst)
    link.expect(message, dst)
    if link.is_store:
        # a record of another model filed under this model's key must still be refused
        good = link.message(src, dst)
        link.put(good, keys)
        foreign = split_records(message, keys)
        corrupt_record(link, keys[0], lambda rec: foreign[0])
        with pytest.raises(TransferError, match="missing 1 of 2"):
            link.fetch(message.transfer_id, dst, keys)
    else:
        with pytest.raises((TransferError, TimeoutError)):
            link.deliver(message, dst, keys)
    assert link.digests(dst) == before
    link.peer.ok("abort", transfer_id=message.transfer_id.hex())
    link.assert_nothing_reserved()


def test_duplicate_transfer_id_is_refused(link):
    src, dst = [8, 12], [37, 38]
    message = link.message(src, dst)
    keys = fresh_keys(len(src))
    link.expect(message, dst)
    link.deliver(message, dst, keys)
    landed = link.digests(dst)
    refused_before = link.peer.ok("state")["refused"]
    with pytest.raises((TransferError, TimeoutError)):
        link.deliver(message, dst, keys)
    assert link.peer.ok("state")["refused"] > refused_before
    assert link.digests(dst) == landed
    # and a new expectation cannot reuse the id either
    assert not link.peer.call("expect", transfer_id=message.transfer_id.hex(), blocks=[39],
                              within_s=5)["ok"]
    link.assert_nothing_reserved()


def test_receiver_deadline_releases_blocks(link):
    message = link.message([13], [41])
    link.expect(message, [41], within_s=0.3)
    events: list = []
    deadline = time.monotonic() + 10
    while True:  # the peer expires the expectation once its deadline has passed
        state = link.peer.ok("state")
        events += [e["ok"] for e in state["events"] if e["transfer_id"] == message.transfer_id.hex()]
        if events:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    assert state["pending"] == [] and state["reserved"] == []
    assert events == [False]
    keys = fresh_keys(1)
    with pytest.raises((TransferError, TimeoutError)):  # a late write is refused
        link.deliver(message, [41], keys)
    link.assert_nothing_reserved()


@pytest.fixture
def silent_listener():
    """A TCP listener that accepts connections and never answers."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                held.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(timeout=5)
    for conn in held:
        conn.close()
    server.close()


def test_unanswering_peer_hits_deadline(link, silent_listener):
    message = link.message([14, 15], [42, 43])
    if link.name == "disk":
        pytest.skip("a directory has no peer that can hang; the receiver-side deadline is "
                    "covered by test_receiver_deadline_releases_blocks")
    start = time.monotonic()
    if link.name == "redis":
        from pdserve.kvtransfer.backends.redis import RedisStore

        store = RedisStore(f"redis://127.0.0.1:{silent_listener}/0", timeout_s=1.0)
        try:
            assert store.put([1, 2], message) == 0
            assert store.get([1, 2], message_limits()) == [None, None]
            assert not store.health.is_healthy or store.health.num_consecutive_failures >= 1
        finally:
            store.close()
        assert time.monotonic() - start < 2 * 1.0 + SLACK_S
        return
    deadline_s = 1.5
    with pytest.raises((TimeoutError, TransferError)):
        link.backend.send(f"127.0.0.1:{silent_listener}", message, time.monotonic() + deadline_s)
    assert time.monotonic() - start < deadline_s + SLACK_S


def message_limits():
    from pdserve.kvtransfer.sink import limits_for

    return limits_for(LAYOUT)


def test_close_is_idempotent(link):
    """Runs last for each backend (it closes the peer's side)."""
    link.peer.ok("close")
    link.backend.close()
    link.backend.close()
    link.assert_nothing_reserved()
