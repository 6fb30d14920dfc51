"""Helpers any test may import (`import support`): a real Redis server process, and a clock
tests advance by hand.

The Redis server lives in the package (`pdserve.kvtransfer.local_redis`, shared with
`pdserve bench transfer`); tests stop it on teardown.
"""
from __future__ import annotations

from pdserve.kvtransfer.local_redis import RedisServer, redis_server_binary

__all__ = ["FakeClock", "RedisServer", "redis_server_binary"]


class FakeClock:
    """A clock for components that take one (`clock=`): time moves only when a test sets
    or adds to `now`, so cool-downs, TTLs and ages are tested without sleeping."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
