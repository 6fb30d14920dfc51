"""The router's typed configuration, built once from the CLI's merged settings.

Values from PDSERVE_* variables arrive as strings; `RouterConfig.from_settings` converts and
validates everything here, so the rest of the router sees typed values only.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from pdserve.common.flags import security, setting
from pdserve.common.values import coerce
from pdserve.security.slow_clients import HttpLimits

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


ROUTER_GROUPS = ("common", "listeners", "routing", "workers")  # "routing": `up` takes and passes them on


def _opt(default: Any, help: str, group: str, **kw: Any) -> Any:
    return setting(default, help, group, roles=("router",), **kw)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Every router setting; those declared with `_opt` are its flags (the one table)."""

    host: str = _opt("127.0.0.1", "address to bind listeners to", "common")
    log_level: str = _opt("INFO", "DEBUG, INFO, WARNING, ERROR", "common")
    cluster_secret_file: str = security("cluster_secret_file", "", roles=("router",))
    internal_tls_cert: str = security("internal_tls_cert", "", roles=("router",))  # registry, router -> workers
    internal_tls_key: str = security("internal_tls_key", "", roles=("router",))
    internal_tls_ca: str = security("internal_tls_ca", "", roles=("router",))
    insecure_internal: bool = security("insecure_internal", False, roles=("router",))
    metrics_port: int = _opt(0, "extra Prometheus listener (0: only HTTP /metrics)", "listeners")
    http_port: int = _opt(ROUTER_HTTP_PORT, "HTTP port", "listeners")  # 0 picks a free port
    grpc_port: int = _opt(ROUTER_GRPC_PORT, "gRPC port of the client API (Generation)", "listeners")
    http_header_timeout_s: float = _opt(10.0, "an HTTP connection's request headers must arrive within this "
                                        "many seconds of its start (or of its last response); else it is "
                                        "closed", "listeners")
    http_idle_timeout_s: float = _opt(5.0, "an HTTP connection idle this long between requests is closed",
                                      "listeners")
    http_max_connections: int = _opt(4096, "HTTP connections open at once (one more is closed at once; past "
                                     "half of them waiting for headers, the oldest such is closed)", "listeners")
    internal_host: str = _opt("", "address the worker registry binds (empty: --host); `pdserve up` keeps it on "
                              "loopback unless its --internal-host says otherwise", "listeners")
    registry_port: int = _opt(ROUTER_REGISTRY_PORT, "gRPC port where workers register (internal; keep it off "
                              "client networks)", "listeners")
    api_key: str | None = _opt(None, "require 'Authorization: Bearer KEY' (prefer --api-key-file or "
                               "PDSERVE_API_KEY: flags show in ps)", "routing")
    api_key_file: str = _opt("", "file holding the API key (mode 0600, or a Secret volume's): as --api-key, "
                             "shown by no flag or environment", "routing")
    metrics_token_file: str = _opt("", "file holding a bearer token (mode 0600, or a Secret volume's): /metrics "
                                   "(HTTP and --metrics-port) answers only 'Authorization: Bearer <it>'",
                                   "routing")
    admin_api_key_file: str = _opt("", "file holding the admin key (mode 0600): callers sending 'Authorization: "
                                   "Bearer <it>' see pdserve's internals (routing, transfer verdicts, timings, "
                                   "worker details on /health, workers' errors); with neither key set, every "
                                   "caller does", "routing")
    enrollment_public_key: str = _opt("", "hex Ed25519 key that signs workers' enrollment tokens (`pdserve up` "
                                      "makes one per start): a Register then needs the worker's own token, "
                                      "naming its id, role and host; the cluster secret alone admits no worker",
                                      "workers")
    enrollment_public_key_file: str = _opt("", "file holding --enrollment-public-key: hex, a PEM public key or "
                                           "a PEM certificate of the key (the chart's enrollment Secret)", "workers")
    revoked_workers_file: str = _opt("", "file of revoked worker ids, one a line, read again when it changes: "
                                     "each is removed and refused (needs --enrollment-public-key)", "routing")
    api_keys_file: str = _opt("", "file of client keys, one 'TENANT KEY [requests_per_minute=N] "
                              "[tokens_per_minute=N] [in_flight=N]' a line (# comments; mode 0600), read again "
                              "when it changes: each tenant prefix-caches apart from the others, under its "
                              "limits (429 with Retry-After past one)", "routing")
    check_prefix_claims: bool = _opt(False, "a worker's KV events count for prefix-aware routing only for blocks "
                                     "this router sent it: a worker cannot capture a popular prefix's prompts "
                                     "by claiming it (affinity starts afresh after a router restart)", "routing")
    metrics_auth: bool = _opt(False, "/metrics requires the API key too (/health and /ready stay open)", "routing")
    tls_cert: str = _opt("", "PEM certificate (chain) for HTTPS and gRPC TLS on the client ports", "routing")
    tls_key: str = _opt("", "PEM private key of --tls-cert", "routing")
    max_queue: int = _opt(256, "requests in flight before 429", "routing")
    prefill_policy: str = _opt("least_loaded", "how to pick a prefill worker", "routing", choices=POLICY_NAMES)
    decode_policy: str = _opt("prefix_aware", "how to pick a decode worker (prefix_aware: cache affinity while "
                              "it pays and the pool stays balanced)", "routing", choices=POLICY_NAMES)
    local_prefill_threshold: int = _opt(32, "uncached prompt tokens at or under which decode prefills locally",
                                        "routing")
    prefill_queue_threshold: int = _opt(8, "a prefill worker's queue length at or over which decode prefills "
                                        "locally", "routing")
    static_routing: bool = _opt(False, "between those thresholds always ask a prefill worker (default: the path "
                                "with the shorter predicted time to first token, from each worker's queued "
                                "prompt tokens and prefill rate)", "routing")
    link_probe_interval_s: float = _opt(30.0, "a prefill-decode link priced out of use gets one prompt again "
                                        "once its measurement is this old, and at most one per this many "
                                        "seconds (0: never)", "routing")
    max_body_bytes: int = _opt(4 * 1024 * 1024, "largest request body in bytes", "routing")
    worker_timeout_s: float = _opt(10.0, "heartbeat age that marks a worker dead", "routing")
    stream_idle_timeout_s: float = _opt(30.0, "a decode stream silent this long is cut off and its request "
                                        "migrated (workers send keep-alives at a quarter of it)", "routing")
    max_migrations: int = _opt(2, "times one request may move to another decode when its own dies or hangs "
                               "mid-stream (0: never)", "routing")
    lenient_json_schema: bool = _opt(False, "JSON schemas (response_format, guided_json, tools) as JSON Schema "
                                     "reads them: an object without additionalProperties takes any other key "
                                     "(default: closed, as xgrammar and vLLM's users expect)", "routing")
    static_workers: tuple[StaticWorker, ...] = _opt((), "comma list of role=host:port to use without "
                                                    "registration", "workers")
    # Not flags (tests shorten them):
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S  # what the router asks workers for
    enable_lora: bool = _opt(False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (admin key "
                             "only), which load and unload an adapter on every worker", "workers")
    rpc_timeout_s: float = 10.0  # ModelInfo, Load, Abort calls to workers
    retry_after_s: int = 1  # Retry-After of a 429
    max_indexed_blocks_per_worker: int = 1 << 20  # KV event index bound per worker, all tiers together
    metrics_token: str = dataclasses.field(default="", repr=False)  # read from --metrics-token-file

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port", "registry_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"{name} must be in [0, 65535]")
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICY_NAMES:
                raise ConfigError(f"{name} must be one of {', '.join(POLICY_NAMES)}")
        try:
            self.http_limits
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.max_queue < 1:
            raise ConfigError("max_queue must be >= 1")
        if self.local_prefill_threshold < 0:
            raise ConfigError("local_prefill_threshold must be >= 0")
        if self.prefill_queue_threshold < 1:
            raise ConfigError("prefill_queue_threshold must be >= 1")
        if self.max_migrations < 0:
            raise ConfigError("max_migrations must be >= 0")
        if self.link_probe_interval_s < 0:
            raise ConfigError("link_probe_interval_s must be >= 0")
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
        self._read_key_files()
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.metrics_auth and self.api_key is None:
            raise ConfigError("--metrics-auth needs --api-key")  # the metrics port's one bearer

    def _read_key_files(self) -> None:
        """--api-key-file and --metrics-token-file, read once here (a bad file stops the start)."""
        from pdserve.security.client_keys import ClientKeyError, load_key_file
        from pdserve.security.secret import ClusterSecretError

        try:
            if self.api_key_file:
                if self.api_key is not None:
                    raise ConfigError("--api-key and --api-key-file: give one")
                object.__setattr__(self, "api_key", load_key_file(self.api_key_file, "API key"))
            if self.metrics_token_file:
                object.__setattr__(self, "metrics_token", load_key_file(self.metrics_token_file, "metrics token"))
        except (ClientKeyError, ClusterSecretError) as exc:
            raise ConfigError(str(exc)) from None

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(self.http_header_timeout_s, self.http_idle_timeout_s, self.http_max_connections)

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
