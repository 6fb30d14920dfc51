"""Typed settings of a prefill or decode service, and the port each role listens on by default.

`WorkerSettings.from_settings` takes the CLI's merged dict (flags > PDSERVE_* > YAML; values
from the environment or YAML may be strings), types and validates it once.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from pdserve.common.errors import InvalidRequestError
from pdserve.common.values import coerce

# Default ports of each role's listeners (0 for a port picks a free one).
PREFILL_GRPC_PORT = 50060
DECODE_GRPC_PORT = 50070
DECODE_TRANSFER_PORT = 50100  # UCX listener; the NCCL/gloo store listens on this port + 1
DEFAULT_GRPC_PORT = {"prefill": PREFILL_GRPC_PORT, "decode": DECODE_GRPC_PORT}


class SettingsError(InvalidRequestError):
    """A setting has a value it cannot take."""


# Where a role's default differs from the field's. The prefill service runs prompts only:
# the shortest first, in a step sized for it, lets a short chat that arrives behind a long
# prompt get its first token about as fast as alone (1.1x its solo TTFT behind a 2,000-token
# prompt; 3.3x when the two share 256-token steps evenly, 60-86x first come first served;
# `pdserve bench mixed-prefill` measures policy x budget; docs in the README).
# The decode service runs a 256-token step too, so a wave of prompts it prefills locally is
# cut into chunks with the running decodes riding in every step: at c8 on SmolLM2-135M
# (2-core CPU, issue 13) 2,048 tokens stalled every decode 3.4 s in one 1,400-token step,
# 256 cut TTFT p50 from 4.1 to 1.6 s with the same throughput.
ROLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "prefill": {"chunking_policy": "SHORTEST_FIRST", "max_num_tokens": 256},
    "decode": {"max_num_tokens": 256},
}


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    role: str
    model: str = "default"
    served_model_name: str = ""
    dtype: str = "float32"
    quantization: str = "none"
    device: str = "cpu"
    num_threads: int = 0
    block_size: int = 16
    max_kv_tokens: int = 0
    free_memory_fraction: float = 0.9
    max_num_tokens: int = 2048
    max_batch_size: int = 64
    max_model_len: int = 0
    attention_window: int = 0  # keep only the last W tokens' KV blocks (0: none beyond the model's own)
    capacity_policy: str = "GUARANTEED_NO_EVICT"
    chunking_policy: str = "FIRST_COME_FIRST_SERVED"
    host: str = "127.0.0.1"
    grpc_port: int = 0  # from_settings: the role's default port
    advertise_host: str = ""
    router: str = ""
    worker_id: str = ""
    heartbeat_s: float = 2.0
    kv_backends: str = "ucx,nccl,redis,disk"
    transfer_port: int = 0  # from_settings: DECODE_TRANSFER_PORT for decode
    redis_url: str = ""
    disk_store: str = ""
    disk_store_max_gb: float = 10.0
    prefix_store: str = "none"  # "disk" | "redis": a persistent prefix cache in that store
    transfer_timeout_s: float = 10.0
    kv_probe_cooldown_s: float = 5.0  # an unhealthy backend is skipped this long, then probed
    prefill_timeout_s: float = 60.0
    failure_policy: str = "recompute"
    max_queue: int = 64
    metrics_port: int = 0
    log_level: str = "INFO"
    cluster_secret_file: str = ""  # internal calls authenticated with this deployment's secret
    insecure_internal: bool = False  # allow a non-loopback bind without a cluster secret
    internal_tls_cert: str = ""  # mutual TLS on internal gRPC: this deployment's certificate,
    internal_tls_key: str = ""  # its key,
    internal_tls_ca: str = ""  # and the CA every peer's certificate must chain to

    @classmethod
    def default(cls, role: str, name: str) -> Any:
        """What `name` is when no flag, variable or YAML key sets it, for this role."""
        if name == "grpc_port":
            return DEFAULT_GRPC_PORT[role]
        if name == "transfer_port":
            return DECODE_TRANSFER_PORT if role == "decode" else 0
        if name in ROLE_DEFAULTS.get(role, {}):
            return ROLE_DEFAULTS[role][name]
        return cls.__dataclass_fields__[name].default

    @classmethod
    def from_settings(cls, role: str, settings: Mapping[str, Any]) -> "WorkerSettings":
        """Typed from the CLI's merged dict (values from env/YAML may be strings); the
        role's port defaults apply where nothing was given."""
        values: dict[str, Any] = {"role": role, "grpc_port": cls.default(role, "grpc_port"),
                                  "transfer_port": cls.default(role, "transfer_port"),
                                  **ROLE_DEFAULTS.get(role, {})}
        for f in fields(cls):
            if f.name == "role" or settings.get(f.name) is None:
                continue
            raw = settings[f.name]
            try:
                values[f.name] = coerce(raw, f.default)
            except (TypeError, ValueError):
                raise SettingsError(f"--{f.name.replace('_', '-')}: cannot use {raw!r}") from None
        out = cls(**values)
        if out.failure_policy not in ("recompute", "fail"):
            raise SettingsError("--failure-policy must be recompute or fail")
        if out.attention_window < 0:
            raise SettingsError("--attention-window must be >= 0 (0: none)")
        if out.quantization not in ("none", "int8"):
            raise SettingsError("--quantization must be none or int8")
        if out.prefix_store not in ("none", "disk", "redis"):
            raise SettingsError("--prefix-store must be disk, redis or none")
        where = {"disk": ("disk_store", "--disk-store"), "redis": ("redis_url", "--redis-url")}
        if out.prefix_store in where and not getattr(out, where[out.prefix_store][0]):
            raise SettingsError(f"--prefix-store {out.prefix_store} needs {where[out.prefix_store][1]}")
        return out

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(b.strip() for b in self.kv_backends.split(",") if b.strip())

    def transfer_config(self, secret=None):
        """The transfer layer's config (`KVTransferConfig`); its keys derive from the cluster
        `secret` (`common.auth.ClusterSecret`) when there is one."""
        from pdserve.common import envs
        from pdserve.kvtransfer.config import KVTransferConfig

        return KVTransferConfig.from_settings(
            backends=self.kv_backends, host=self.host, transfer_port=self.transfer_port,
            redis_url=self.redis_url or None, disk_store=self.disk_store or None,
            disk_store_max_gb=self.disk_store_max_gb, step_timeout_s=self.transfer_timeout_s,
            probe_cooldown_s=self.kv_probe_cooldown_s,
            prefix_cache=self.prefix_store if self.prefix_store != "none" else None,
            layerwise=envs.get("PDSERVE_KV_LAYERWISE") != "0",
            transfer_key=secret.key("transfer") if secret else None,
            store_key=secret.key("store") if secret else None)

    def engine_config(self):
        from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

        return EngineConfig(
            model=self.model, dtype=self.dtype, device=self.device,
            quantization="" if self.quantization == "none" else self.quantization,
            num_threads=self.num_threads or None,
            cache=CacheConfig(block_size=self.block_size, max_tokens=self.max_kv_tokens or None,
                              free_memory_fraction=self.free_memory_fraction, dtype=self.dtype,
                              attention_window=self.attention_window or None),
            scheduler=SchedulerConfig(
                capacity_policy=self.capacity_policy, chunking_policy=self.chunking_policy,
                max_num_tokens=self.max_num_tokens, max_batch_size=self.max_batch_size,
                max_model_len=self.max_model_len or None))


