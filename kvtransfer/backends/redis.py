"""KV blocks in a Redis server.

Keys: `pdkv:<compat hash, 16 hex>:<block hash, 16 hex>` for content blocks (TTL `ttl_s`,
refreshed on every hit, so a server with `maxmemory-policy allkeys-lru` or the TTL drops the
least recently used), `pdkv:<compat>:t<16 hex>` for short-lived blocks (TTL
`ephemeral_ttl_s`). Each value is a single-block wire message, checked on read.

Every call is pipelined (one round trip per batch) under bounded socket timeouts. A call
whose connection broke (reset, broken pipe: a connection from before a partition or a server
restart) is sent once more on a fresh connection; nothing else is retried, a timeout least
of all. A failing or unreachable server reads as misses and marks the store unhealthy
until a PING answers. The PING runs in the background every cool-down (no request waits on
a server that is down), so the store reads unusable until the server answers again.
"""
from __future__ import annotations

import logging
from typing import Sequence

from pdserve.kvtransfer.base import BlockMessage, BlockStore
from pdserve.kvtransfer.codec import CountsRecordReads, RecordReads, layout_of, split_records
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.health import BackendHealth, HealthPolicy
from pdserve.kvtransfer.wire import WireLimits

log = logging.getLogger(__name__)


def redacted_url(url: str) -> str:
    """`url` without its user and password: what logs and errors may show."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            netloc += f":{parts.port}"
    except ValueError:
        return "redis://<unparsable url>"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def redis_key(compat_hash: int, key: int) -> str:
    prefix = f"pdkv:{compat_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}:"
    return prefix + (f"t{-key:016x}" if key < 0 else f"{key:016x}")


class RedisStore(CountsRecordReads, BlockStore):
    name = "redis"

    def __init__(self, url: str, *, ttl_s: float = 3600.0, ephemeral_ttl_s: float = 120.0,
                 timeout_s: float = 2.0, max_batch: int = 64,
                 health_policy: HealthPolicy = HealthPolicy(), mac_key: bytes | None = None) -> None:
        """`mac_key`: the deployment's store key; records are written with a MAC and a record
        without a valid one is a miss (counted in `num_unauthenticated`)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = (redis.RedisError, OSError)
        self.where = redacted_url(url)  # the url may carry a password: never logged, never sent
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.ephemeral_ttl_ms = max(1, int(ephemeral_ttl_s * 1000))
        self.max_batch = max_batch
        self.health = BackendHealth(self.name, health_policy, probe=self.probe)
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)), retry_on_timeout=False,
            health_check_interval=0)
        self._closed = False
        self.mac_key = mac_key
        self._reads = RecordReads("redis store")

    def _ttl_ms(self, key: int) -> int:
        return self.ephemeral_ttl_ms if key < 0 else self.ttl_ms

    def put(self, block_hashes: Sequence[int], message: BlockMessage, digests: Sequence[bytes] = ()) -> int:
        if not self.can_serve():
            return 0
        compat = layout_of(message).compat_hash
        records = split_records(message, block_hashes, self.mac_key, digests)
        stored = 0
        try:
            for start in range(0, len(records), self.max_batch):
                pipe = self._client.pipeline(transaction=False)
                for key, record in zip(block_hashes[start:start + self.max_batch],
                                       records[start:start + self.max_batch]):
                    pipe.set(redis_key(compat, key), record, px=self._ttl_ms(key))
                stored += sum(1 for ok in pipe.execute() if ok)
        except self._errors as exc:
            self._trouble("put", exc)
            return stored
        self.health.record_success()
        return stored

    def get(self, block_hashes: Sequence[int], limits: WireLimits,
            digests: Sequence[bytes] | None = None) -> list[memoryview | None]:
        out: list[memoryview | None] = [None] * len(block_hashes)
        if not block_hashes or not self.can_serve():
            return out
        names = [redis_key(limits.compat_hash, k) for k in block_hashes]
        try:
            for start in range(0, len(names), self.max_batch):
                values = self._client.mget(names[start:start + self.max_batch])
                for i, value in enumerate(values, start):
                    if value is not None:
                        out[i] = self._check(value, limits, block_hashes[i], names[i],
                                             digests[i] if digests is not None else None)
            hits = [(n, k) for n, k, v in zip(names, block_hashes, out) if v is not None]
            if hits:  # refresh the TTL of what was used: least recently used expires first
                pipe = self._client.pipeline(transaction=False)
                for name, key in hits:
                    pipe.pexpire(name, self._ttl_ms(key))
                pipe.execute()
        except self._errors as exc:
            self._trouble("get", exc)
            return [None] * len(block_hashes)
        self.health.record_success()
        return out

    def _check(self, value: bytes, limits: WireLimits, key: int, name: str,
               digest: bytes | None) -> memoryview | None:
        return self._reads.payload(value, limits, key, self.mac_key, digest, name,
                                   lambda: self._client.delete(name))

    def count_prefix_hits(self, block_hashes: Sequence[int], compat_hash: int) -> int:
        if not block_hashes or not self.can_serve():
            return 0
        n = 0
        try:
            for start in range(0, len(block_hashes), self.max_batch):
                pipe = self._client.pipeline(transaction=False)
                for key in block_hashes[start:start + self.max_batch]:
                    pipe.exists(redis_key(compat_hash, key))
                for present in pipe.execute():
                    if not present:
                        return n
                    n += 1
        except self._errors as exc:
            self._trouble("count", exc)
            return 0
        self.health.record_success()
        return n

    def discard(self, block_hashes: Sequence[int], compat_hash: int) -> None:
        if not block_hashes or not self.health.is_healthy:
            return
        try:
            self._client.delete(*(redis_key(compat_hash, k) for k in block_hashes))
        except self._errors as exc:
            self._trouble("discard", exc)

    def probe(self) -> bool:
        if self._closed:  # a background probe racing close() opens no new connection
            return False
        try:
            self._client.ping()
        except self._errors as exc:
            self._trouble("probe", exc)
            return False
        self.health.record_success()
        return True

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.health.close()
            self._client.close()

    def _trouble(self, what: str, exc: Exception) -> None:
        log.warning("redis store %s: %s failed: %s", self.where, what, exc)
        self.health.record_failure(f"{what}: {exc.__class__.__name__}: {exc}")


def create_store(config: KVTransferConfig) -> RedisStore:
    """Registry factory: the server at `config.redis_url` (the `redis` package loads here)."""
    return RedisStore(config.redis_url, ttl_s=config.store_ttl_s, ephemeral_ttl_s=config.ephemeral_ttl_s,
                      timeout_s=config.redis_timeout_s, health_policy=config.health_policy,
                      mac_key=config.store_key)
