"""A connection the Redis store holds from before a partition is found broken on its next
use and replaced: the call goes through on a fresh connection and the store stays healthy.
A real Redis server behind a proxy that resets, at their next request, the connections that
were open when it was told to (as a peer that lost their state across a partition does)."""
from __future__ import annotations

import contextlib
import socket
import struct
import threading

import pytest

from pdserve.kvtransfer.codec import encode_message
from pdserve.kvtransfer.sink import limits_for
from pdserve.kvtransfer.wire import payload_nbytes
from kvcaches import tiny_layout

LAYOUT = tiny_layout(num_blocks=16)
LIMITS = limits_for(LAYOUT)
BLOCK_NBYTES = payload_nbytes(1, LAYOUT.num_layers, LAYOUT.block_size, LAYOUT.num_kv_heads,
                              LAYOUT.head_dim, LAYOUT.dtype)


class ResettingProxy:
    """127.0.0.1:`port` forwarded to `upstream`; `reset_open()`: every connection open now is
    reset (RST) when its client next sends, instead of being forwarded."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.generation = 0
        self.num_reset = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def reset_open(self) -> None:
        self.generation += 1

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                server = socket.create_connection(self.upstream, timeout=10)
                born = self.generation
                threading.Thread(target=self._pump, args=(client, server, born), daemon=True).start()
                threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, born: int | None) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if born is not None and born < self.generation:  # from before the "partition"
                    self.num_reset += 1
                    src.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
                dst.sendall(data)
        for s in (src, dst):
            s.close()

    def close(self) -> None:
        self.listener.close()


def _message(keys, fill: int):
    return encode_message(LIMITS, bytes(16), [0] * len(keys), keys, bytes([fill]) * (BLOCK_NBYTES * len(keys)))


@pytest.fixture
def proxied(redis_server):
    from urllib.parse import urlsplit

    from pdserve.kvtransfer.backends.redis import RedisStore

    parts = urlsplit(redis_server.url)
    proxy = ResettingProxy((parts.hostname, parts.port))
    url = redis_server.url.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{proxy.port}")
    store = RedisStore(url, mac_key=b"k" * 32)
    yield store, proxy
    store.close()
    proxy.close()


def test_a_connection_from_before_a_partition_is_replaced_on_its_next_use(proxied):
    store, proxy = proxied
    assert store.put([11, 12], _message([11, 12], fill=5)) == 2
    proxy.reset_open()
    assert [bytes(v) for v in store.get([11, 12], LIMITS)] == [bytes([5]) * BLOCK_NBYTES] * 2
    proxy.reset_open()
    assert store.put([13], _message([13], fill=6)) == 1
    assert proxy.num_reset == 2  # both calls met a reset connection, and went through anyway
    assert store.health.is_healthy and store.health.num_consecutive_failures == 0


def test_a_server_that_is_gone_is_a_miss_and_a_failure(proxied, redis_server):
    store, _ = proxied
    assert store.put([21], _message([21], fill=1)) == 1
    redis_server.stop()
    assert store.get([21], LIMITS) == [None]
    assert store.health.num_consecutive_failures == 1
