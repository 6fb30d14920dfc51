"""Typed settings of the transfer layer (the `kv transfer` CLI flags map onto these)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.errors import InvalidRequestError
from pdserve.kvtransfer.health import HealthPolicy
from pdserve.kvtransfer.verdict import RECOMPUTE


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """A content-addressed store, registered by name. Its module,
    `pdserve.kvtransfer.backends.<name>`, provides `create_store(config) -> BlockStore` and
    imports its heavy dependency only there (`backend_loader` imports the module when the
    store is opened). `location` names the `KVTransferConfig` field (and the worker flag of
    the same name) that places the store: unset, the store is not configured."""

    name: str
    location: str
    # A hand-off names a store, never locates it (each side opens its own): it shows the
    # location only when the location can carry no secret.
    shows_location: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.location.replace("_", "-")


# The backend names and the defaults below are declared here only: worker flags, the CLI's
# help, benchmarks and the Helm chart (a test ties its values.yaml) take them from here.
TRANSPORTS = ("ucx", "nccl")  # point-to-point: modules kvtransfer/backends/<name>.py
STORE_SPECS = {spec.name: spec for spec in (StoreSpec("redis", "redis_url"),
                                            StoreSpec("disk", "disk_store", shows_location=True))}
STORES = tuple(STORE_SPECS)
BACKENDS = TRANSPORTS + STORES
DEFAULT_CHAIN = BACKENDS + (RECOMPUTE,)  # every backend, transports first; recompute ends it
DISK_STORE_MAX_GB = 10.0  # the disk store's size budget (GiB): pruned least recently used first


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """Which backends exist on this worker, and how they behave.

    `backends` is the fallback chain in order; "recompute" ends it (leave it out to fail
    instead). A store backend is only usable when its location is set (its
    `StoreSpec.location`: `redis_url`, `disk_store`). `prefix_cache` names a store also used
    as a persistent prefix cache: prompts load matching blocks from it and store their new
    full blocks in it.
    """

    backends: tuple[str, ...] = DEFAULT_CHAIN
    host: str = "127.0.0.1"  # where transports listen
    transfer_port: int = 0  # 0: transports pick free ports
    redis_url: str | None = field(default=None, repr=False)  # may carry a password: never shown
    redis_timeout_s: float = 2.0
    disk_store: str | None = None
    disk_store_max_gb: float = DISK_STORE_MAX_GB
    disk_store_max_records: int = 1_000_000
    store_ttl_s: float = 3600.0  # content blocks in redis
    ephemeral_ttl_s: float = 120.0  # partial blocks parked in a store for one transfer
    step_timeout_s: float = 10.0  # deadline of one backend's attempt
    failure_threshold: int = 3  # failures in a row that mark a backend unhealthy
    probe_cooldown_s: float = 5.0  # how long an unhealthy backend is skipped before a probe
    prefix_cache: str | None = None  # one of STORES, or None
    load_timeout_s: float = 10.0  # deadline of a prefix-cache lookup + fetch
    host_offload_bytes: int = 0  # the host-memory tier under the pool (kvtransfer.tiers); 0: none
    layerwise: bool = True  # a sender streams each layer of each prompt chunk (ucx/nccl)
    # From the cluster secret (None: no secret configured): peers of the ucx/nccl control
    # channels prove they hold `transfer_key`; store records carry a MAC under `store_key`.
    transfer_key: bytes | None = field(default=None, repr=False)
    store_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", tuple(self.backends))
        unknown = [b for b in self.backends if b not in BACKENDS + (RECOMPUTE,)]
        if unknown:
            raise InvalidRequestError(f"unknown kv backends {unknown}; known: {BACKENDS}")
        if RECOMPUTE in self.backends[:-1]:
            raise InvalidRequestError("'recompute' can only end the chain")
        if len(set(self.backends)) != len(self.backends):
            raise InvalidRequestError(f"kv backends repeat: {self.backends}")
        if self.prefix_cache is not None and self.prefix_cache not in STORES:
            raise InvalidRequestError(f"prefix_cache must be one of {STORES}")
        if self.host_offload_bytes < 0:
            raise InvalidRequestError("host_offload_bytes must be >= 0")
        if self.step_timeout_s <= 0 or self.load_timeout_s <= 0 or self.redis_timeout_s <= 0:
            raise InvalidRequestError("timeouts must be positive")

    @classmethod
    def from_settings(cls, backends: str | None = None, **kwargs) -> "KVTransferConfig":
        """From CLI-style values (None = default): `backends` as "ucx,nccl,redis,disk";
        "recompute" is appended unless the list names it."""
        if backends:
            names = tuple(b.strip() for b in backends.split(",") if b.strip())
            kwargs["backends"] = names if RECOMPUTE in names else names + (RECOMPUTE,)
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    @property
    def health_policy(self) -> HealthPolicy:
        return HealthPolicy(self.failure_threshold, self.probe_cooldown_s)

    def store_configured(self, name: str) -> bool:
        return bool(getattr(self, STORE_SPECS[name].location))

    def store_endpoint(self, name: str) -> str:
        """What a hand-off shows for store `name` ("" when it is not configured here)."""
        spec = STORE_SPECS[name]
        if not self.store_configured(name):
            return ""
        return getattr(self, spec.location) if spec.shows_location else name
