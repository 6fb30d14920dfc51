"""A pair's process-group rendezvous over its authenticated control connection (`nccl`).

torch.distributed's process groups meet through a key-value store: gloo publishes each rank's
listening address under a key the other rank waits for; NCCL's rank 0 publishes its unique id
(the address and random magic of its bootstrap listener) for rank 1. `PairStore` is that store
for a two-rank pair, with no listener of its own: a `set` goes to the peer as a frame sealed by
the control connection's session (`_p2p.Session`), and a `get` or `wait` reads the peer's
frames until the key is there. No key or value crosses a port that takes anonymous clients,
and nothing an unauthenticated peer sends is kept.

Frames (little-endian; each followed by its session tag, like every control frame)::

    KEY   RDV (12 B): magic b"PDRV", kind 0, key length, value length; + key (UTF-8) + value
    DONE  RDV with kind 1, no key, no value: this side's group is up and has moved its first bytes

The rendezvous is open from the group's construction through its first payload (NCCL builds its
communicator then); `finish` sends our DONE and reads up to the peer's, after which the control
connection carries requests again and the store only answers from what it holds: a key not
published by then never arrives. A rendezvous takes at most MAX_KEYS keys from the peer, each
at most MAX_KEY + MAX_VALUE bytes, all checked before the bytes are read.
"""
from __future__ import annotations

import datetime
import socket
import struct
import threading
import time
from typing import Callable

import torch.distributed as dist

from pdserve.common.errors import TransferError
from pdserve.kvtransfer.backends import _p2p

RDV = struct.Struct("<4sBxHI")  # magic, kind, (pad), key length, value length
RDV_MAGIC = b"PDRV"
KIND_KEY, KIND_DONE = 0, 1
MAX_KEYS = 64  # gloo publishes one key per rank, NCCL one unique id per communicator
MAX_KEY = 256
MAX_VALUE = 64 << 10  # a gloo address list or an NCCL unique id is a few hundred bytes


class RendezvousError(TransferError):
    """The peer broke the rendezvous: a malformed frame, too many keys, or a key it never sent."""


def _as_bytes(value: object) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)


class PairStore(dist.Store):
    """The store of one pair's group: see the module docstring. Built by the pairing thread
    on a control connection that has authenticated and said hello; that thread runs the
    rendezvous (the group's constructor and first payload, then `finish`). Other threads
    (a process group's monitors) may call it too: they are answered from what it holds."""

    def __init__(self, sock: socket.socket, session: _p2p.Session, deadline: float,
                 before_publish: Callable[[bytes], object] = lambda value: None) -> None:
        """`before_publish(value)` runs before a value of ours goes to the peer."""
        super().__init__()
        self._before_publish = before_publish
        self._sock: socket.socket | None = sock
        self._session: _p2p.Session | None = session
        self._deadline = deadline
        self._values: dict[str, bytes] = {}
        self.published: list[bytes] = []  # what this side set while open (its listeners' addresses)
        self._num_received = 0
        self._peer_done = False
        self._io = threading.Lock()  # one reader/writer of the control connection at a time

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    # -- torch.distributed.Store ----------------------------------------------------------------
    def set(self, key: str, value) -> None:
        data = _as_bytes(value)
        with self._io:
            self._values[key] = data
            if self.is_open:
                self.published.append(data)
                self._before_publish(data)
                self._send(KIND_KEY, key.encode("utf-8"), data)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._values[key]

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        deadline = self._deadline
        if timeout is not None:
            deadline = min(deadline, time.monotonic() + timeout.total_seconds())
        with self._io:
            while missing := [key for key in keys if key not in self._values]:
                if not self.is_open or self._peer_done:
                    raise RendezvousError(f"the rendezvous is over and key {missing[0]!r} never came")
                self._receive(deadline)

    def check(self, keys: list[str]) -> bool:
        return all(key in self._values for key in keys)

    def add(self, key: str, amount: int) -> int:
        """A counter of this side only: the pair's ranks share no counter (neither gloo's
        rendezvous nor NCCL's point-to-point set-up uses one)."""
        with self._io:
            total = int(self._values.get(key, b"0")) + amount
            self._values[key] = str(total).encode()
        return total

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected, desired = _as_bytes(expected), _as_bytes(desired)
        with self._io:
            current = self._values.get(key)
            if (current is None and not expected) or current == expected:
                self._values[key] = desired
                return desired
            return expected if current is None else current

    def delete_key(self, key: str) -> bool:
        with self._io:
            return self._values.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._values)

    # -- the rendezvous's end -------------------------------------------------------------------
    def finish(self, deadline: float) -> None:
        """Say our group is up and read the peer's frames up to its DONE; from then on the
        control connection is the caller's and the store answers locally."""
        with self._io:
            if not self.is_open:
                return
            self._send(KIND_DONE, b"", b"")
            while not self._peer_done:
                self._receive(deadline)
            self._sock = self._session = None

    def _send(self, kind: int, key: bytes, value: bytes) -> None:
        if len(key) > MAX_KEY or len(value) > MAX_VALUE:
            raise RendezvousError(f"rendezvous key {key[:64]!r} is too long to publish")
        frame = RDV.pack(RDV_MAGIC, kind, len(key), len(value)) + key + value
        _p2p.send_all(self._sock, self._session.seal(frame), self._deadline)

    def _receive(self, deadline: float) -> None:
        """One frame of the peer's, checked: its bounds before its bytes, then its tag."""
        head = _p2p.recv_exactly(self._sock, RDV.size, deadline)
        magic, kind, key_len, value_len = RDV.unpack(head)
        if magic != RDV_MAGIC or kind not in (KIND_KEY, KIND_DONE) or key_len > MAX_KEY or value_len > MAX_VALUE:
            raise RendezvousError("a malformed rendezvous frame")
        if kind == KIND_KEY and self._num_received >= MAX_KEYS:
            raise RendezvousError(f"the peer published more than {MAX_KEYS} rendezvous keys")
        rest = _p2p.recv_exactly(self._sock, key_len + value_len + _p2p.TAG_BYTES, deadline)
        frame = self._session.open(head + rest[:-_p2p.TAG_BYTES], rest[-_p2p.TAG_BYTES:])
        if kind == KIND_DONE:
            self._peer_done = True
            return
        self._num_received += 1
        body = frame[RDV.size:]
        self._values[body[:key_len].decode("utf-8", "replace")] = body[key_len:]
