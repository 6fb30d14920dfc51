"""The router's typed configuration, built once from the CLI's merged settings.

Values from PDSERVE_* variables arrive as strings; `RouterConfig.from_settings` converts and
validates everything here, so the rest of the router sees typed values only.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from pdserve.common.values import coerce

# Default ports of the router's listeners (0 picks a free port).
ROUTER_HTTP_PORT = 8000
ROUTER_GRPC_PORT = 50050  # clients: Generation (API key)
ROUTER_REGISTRY_PORT = 50051  # workers only: Registry (cluster credentials)
POLICY_NAMES = ("round_robin", "least_loaded", "prefix_aware", "session_affinity", "power_of_two")
DEFAULT_HEARTBEAT_INTERVAL_S = 2.0


class ConfigError(ValueError):
    """A router setting is malformed or out of range."""


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class StaticWorker:
    """A worker the router uses without registration (it polls Load instead)."""

    role: Role
    address: str  # "host:port" of its gRPC service


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"  # HTTP and gRPC listeners bind here
    http_port: int = ROUTER_HTTP_PORT  # 0 picks a free port
    grpc_port: int = ROUTER_GRPC_PORT  # 0 picks a free port
    registry_port: int = ROUTER_REGISTRY_PORT  # 0 picks a free port
    cluster_secret_file: str = ""  # internal calls authenticated with this deployment's secret
    insecure_internal: bool = False  # allow a non-loopback bind without a cluster secret
    metrics_port: int = 0  # extra Prometheus listener; 0: only HTTP /metrics
    api_key: str | None = None  # require "Authorization: Bearer KEY" (HTTP /v1/*, gRPC Generation)
    metrics_auth: bool = False  # /metrics requires the API key too (health and readiness stay open)
    tls_cert: str = ""  # PEM certificate chain: HTTPS and gRPC-over-TLS on the client ports
    tls_key: str = ""  # its PEM private key
    internal_tls_cert: str = ""  # mutual TLS on internal gRPC (registry, router -> workers)
    internal_tls_key: str = ""
    internal_tls_ca: str = ""
    max_queue: int = 256  # requests in flight; one more gets 429 / RESOURCE_EXHAUSTED
    prefill_policy: str = "least_loaded"
    decode_policy: str = "prefix_aware"
    local_prefill_threshold: int = 32  # uncached prompt tokens <= this: decode prefills locally
    prefill_queue_threshold: int = 8  # chosen prefill worker's queue >= this: decode prefills locally
    max_body_bytes: int = 4 * 1024 * 1024
    worker_timeout_s: float = 10.0  # heartbeat silence that makes a worker dead
    stream_idle_timeout_s: float = 30.0  # a Decode stream silent this long (keep-alives included) is cut off
    max_migrations: int = 2  # times one request may move to another decode after losing its own
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S  # what the router asks workers for
    static_workers: tuple[StaticWorker, ...] = ()
    log_level: str = "INFO"
    lenient_json_schema: bool = False  # object schemas without additionalProperties stay open
    # Not CLI flags (tests shorten them):
    rpc_timeout_s: float = 10.0  # ModelInfo, Load, Abort calls to workers
    retry_after_s: int = 1  # Retry-After of a 429
    max_cached_hashes_per_worker: int = 8192  # prefix-aware routing memory per worker

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port", "registry_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be in [0, 65535]")
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICY_NAMES:
                raise ConfigError(f"{name} must be one of {', '.join(POLICY_NAMES)}")
        if self.max_queue < 1:
            raise ConfigError("max_queue must be >= 1")
        if self.local_prefill_threshold < 0:
            raise ConfigError("local_prefill_threshold must be >= 0")
        if self.prefill_queue_threshold < 1:
            raise ConfigError("prefill_queue_threshold must be >= 1")
        if self.max_migrations < 0:
            raise ConfigError("max_migrations must be >= 0")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be >= 1024")
        for name in ("worker_timeout_s", "heartbeat_interval_s", "rpc_timeout_s", "stream_idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0")
        if self.heartbeat_interval_s >= self.worker_timeout_s:
            raise ConfigError("heartbeat_interval_s must be shorter than worker_timeout_s")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(f"unknown log_level {self.log_level!r}")
        if self.api_key == "":
            object.__setattr__(self, "api_key", None)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.metrics_auth and self.api_key is None:
            raise ConfigError("--metrics-auth needs --api-key")

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "RouterConfig":
        """Build from `pdserve router` settings (flags, PDSERVE_* strings, YAML values).
        Unknown keys (other roles' flags, e.g. from `pdserve up`) are ignored."""
        kwargs: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            value = settings.get(field.name)
            if value is None or not field.init:
                continue
            convert = _CONVERTERS.get(field.name) or (lambda v, d=field.default: coerce(v, d))
            try:
                kwargs[field.name] = convert(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"bad value for {field.name}: {value!r} ({exc})") from None
        if "worker_timeout_s" in kwargs and "heartbeat_interval_s" not in kwargs:
            kwargs["heartbeat_interval_s"] = min(DEFAULT_HEARTBEAT_INTERVAL_S, kwargs["worker_timeout_s"] / 3)
        return cls(**kwargs)


def parse_static_workers(value: Any) -> tuple[StaticWorker, ...]:
    """"prefill=h:p,decode=h:p" (or a YAML list of such items) -> StaticWorkers."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    workers = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        role, sep, address = item.partition("=")
        host, colon, port = address.rpartition(":")
        if not sep or not colon or not host or not port.isdigit():
            raise ValueError(f"{item!r} is not role=host:port")
        workers.append(StaticWorker(Role(role.strip().lower()), address.strip()))
    return tuple(workers)


_CONVERTERS: dict[str, Callable[[Any], Any]] = {  # settings no default's type describes
    "static_workers": parse_static_workers,
}
