"""Helpers any test may import (`import support`): a real Redis server process.

The server lives in the package (`pdserve.kvtransfer.local_redis`, shared with
`pdserve bench transfer`); tests stop it on teardown.
"""
from __future__ import annotations

from pdserve.kvtransfer.local_redis import RedisServer, redis_server_binary

__all__ = ["RedisServer", "redis_server_binary"]
