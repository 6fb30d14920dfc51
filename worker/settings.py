"""Typed settings of a prefill or decode service, and the port each role listens on by default.

`WorkerSettings.from_settings` takes the CLI's merged dict (flags > PDSERVE_* > YAML; values
from the environment or YAML may be strings), types and validates it once.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from pdserve.common.errors import InvalidRequestError
from pdserve.common.flags import security, setting
from pdserve.common.values import coerce
from pdserve.kvtransfer.config import BACKENDS, DEFAULT_CHAIN, DISK_STORE_MAX_GB, STORE_SPECS, STORES, KVTransferConfig
from pdserve.kvtransfer.verdict import FAILURE_POLICIES, RECOMPUTE

# Default ports of each role's listeners (0 for a port picks a free one).
PREFILL_GRPC_PORT = 50060
DECODE_GRPC_PORT = 50070
DECODE_TRANSFER_PORT = 50100  # UCX listener; the NCCL/gloo store listens on this port + 1
DEFAULT_GRPC_PORT = {"prefill": PREFILL_GRPC_PORT, "decode": DECODE_GRPC_PORT}


class SettingsError(InvalidRequestError):
    """A setting has a value it cannot take."""


def repeated_values(raw: Any) -> tuple[str, ...]:
    """A repeated setting's values: a list (flags, YAML) as is; a string (a PDSERVE_*
    variable) is a JSON list, or values separated by whitespace."""
    if isinstance(raw, (list, tuple)):
        return tuple(str(v).strip() for v in raw if str(v).strip())
    text = str(raw).strip()
    if text.startswith("["):
        import json

        parsed = json.loads(text)
        if not isinstance(parsed, list):
            raise ValueError("expected a list")
        return tuple(v if isinstance(v, str) else json.dumps(v) for v in parsed)
    return tuple(text.split())


# Where a role's default differs from the field's. The prefill service runs prompts only,
# the shortest first, in a step sized for it: a short chat that arrives behind a long
# prompt gets its first token about as fast as alone (`pdserve bench mixed-prefill`
# measures policy x budget). The decode service runs a 256-token step too, so a wave of
# prompts it prefills locally is cut into chunks with the running decodes riding in every
# step, never stalled behind a whole wave.
ROLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "prefill": {"chunking_policy": "SHORTEST_FIRST", "max_num_tokens": 256},
    "decode": {"max_num_tokens": 256},
}


def _read_token(path: str) -> str:
    """An enrollment token from its private file (one line: its fields are words)."""
    from pdserve.security.enrollment import MAX_TOKEN_CHARS
    from pdserve.security.secret import read_private_file

    text = read_private_file(path, "enrollment token", max_bytes=MAX_TOKEN_CHARS).decode("ascii", "replace").strip()
    if not text or "\n" in text or not text.isprintable():
        raise SettingsError(f"{path}: the enrollment token is one line of printable ASCII")
    return text


def _key_file_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """The settings read from key files (--metrics-token-file, --enrollment-token-file,
    --redis-url-file, --redis-password-file), so that no flag or environment shows them."""
    from urllib.parse import quote

    from pdserve.security.client_keys import ClientKeyError, load_key_file
    from pdserve.security.secret import ClusterSecretError

    out: dict[str, Any] = {}
    try:
        if values.get("metrics_token_file"):
            if values.get("metrics_token"):
                raise SettingsError("--metrics-token and --metrics-token-file: give one")
            out["metrics_token"] = load_key_file(values["metrics_token_file"], "metrics token")
        if values.get("enrollment_token_file"):
            if values.get("enrollment_token"):
                raise SettingsError("--enrollment-token and --enrollment-token-file: give one")
            out["enrollment_token"] = _read_token(values["enrollment_token_file"])
        url = values.get("redis_url") or ""
        if values.get("redis_url_file"):
            if url:
                raise SettingsError("--redis-url and --redis-url-file: give one")
            url = load_key_file(values["redis_url_file"], "Redis URL")
        if values.get("redis_password_file"):
            scheme, sep, rest = url.partition("://")
            if not sep or "@" in rest:
                raise SettingsError("--redis-password-file needs a --redis-url without a password")
            password = quote(load_key_file(values["redis_password_file"], "Redis password"), safe="")
            url = f"{scheme}://:{password}@{rest}"
    except (ClientKeyError, ClusterSecretError) as exc:
        raise SettingsError(str(exc)) from None
    if url:
        out["redis_url"] = url
    return out


GROUPS = ("common", "worker", "engine", "kv transfer", "lifecycle")  # `up` shares all but common and worker


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """Every worker setting, with its flag (`setting`): the one table of the workers' flags."""

    role: str
    # -- engine: `up` passes these to every worker it starts
    model: str = setting("default", "'default' (SmolLM2-135M-Instruct), a transformers dir, or a .gguf", "engine")
    served_model_name: str = setting("", "name clients use in requests (none: from the model)", "engine")
    dtype: str = setting("float32", "weights and KV cache dtype", "engine",
                         choices=("float32", "bfloat16", "float16"))
    quantization: str = setting(
        "auto", "weights: auto (decode: a .gguf model's own blocks on CPU in float32; prefill: float32, "
        "faster for prompts, the same KV), none "
        "(float32), gguf (the .gguf's quantized blocks, float32 activations: same greedy text), "
        "gguf-fast (bfloat16 activations for 4-bit blocks: faster, small differences), gguf-int8dot "
        "(8-bit activations, integer dot products in decode steps: faster, small differences), "
        "gguf-int16dot (the same with 16-bit activations: closer to float32), int8 "
        "(dynamic int8 GEMMs); prefill and decode must agree", "engine",
        choices=("auto", "none", "gguf", "gguf-fast", "gguf-int8dot", "gguf-int16dot", "int8"))
    device: str = setting("cpu", "cpu or cuda[:N]", "engine")
    num_threads: int = setting(0, "torch intra-op threads (0: torch's choice)", "engine")
    block_size: int = setting(16, "tokens per KV block", "engine")
    max_kv_tokens: int = setting(0, "KV cache size in tokens (0: from --free-memory-fraction)", "engine")
    free_memory_fraction: float = setting(
        0.9, "share of the memory free once the weights are loaded that the KV cache takes (GPU: free "
        "device memory; CPU: the OS's available memory); `up` divides it among the workers it starts", "engine")
    max_num_tokens: int = setting(2048, "tokens per engine step", "engine")
    max_batch_size: int = setting(64, "sequences per engine step", "engine")
    max_model_len: int = setting(0, "context length limit (0: the model's)", "engine")
    capacity_policy: str = setting("GUARANTEED_NO_EVICT", "admission under KV pressure", "engine",
                                   choices=("GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"))
    chunking_policy: str = setting("FIRST_COME_FIRST_SERVED", "how prompts share a step's token budget", "engine",
                                   choices=("FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS", "SHORTEST_FIRST"))
    attention_window: int = setting(0, "keep only the last N tokens' KV blocks: attention sees that window (0: none "
                                    "beyond the model's own sliding window; prefill and decode must agree)", "engine")
    seed: int = setting(0, "the engine's random seed: requests without their own seed draw from it", "engine")
    speculative_config: str = setting(
        "", "speculative decoding, vLLM's JSON for the ngram method, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}': decode checks up to that many tokens "
        "copied from the prompt or output per step, when it pays (none: off)", "engine")
    enable_lora: bool = setting(False, "serve LoRA adapters: a request whose model names one runs under it",
                                "engine")
    lora_modules: tuple = setting(
        (), "adapters this worker may serve, each NAME=PATH or JSON {\"name\": ..., \"path\": ..., "
        "\"base_model_name\": ...} (PEFT's adapter_config.json + safetensors); each is checked at start "
        "and loaded on first use", "engine", repeated=True)
    max_loras: int = setting(4, "adapters held in the engine's batch slots at once (more are swapped in, "
                             "least recently used first, never mid-request)", "engine")
    max_lora_rank: int = setting(16, "the largest adapter rank accepted", "engine")
    max_cpu_loras: int = setting(0, "adapters kept in host memory (0: --max-loras)", "engine")
    lora_allowed_root: str = setting("", "adapter paths must lie under this directory (runtime loads "
                                     "included; none: any path)", "engine")
    # -- kv transfer: `up` passes these too
    heartbeat_s: float = setting(2.0, "heartbeat interval to the router; the router's ask caps it", "kv transfer")
    kv_backends: str = setting(",".join(b for b in DEFAULT_CHAIN if b != RECOMPUTE),
                               f"fallback chain, comma separated, of {', '.join(BACKENDS)}; recompute ends it",
                               "kv transfer")
    redis_url: str = setting("", "redis://host:port/db for the redis backend", "kv transfer")
    redis_url_file: str = setting("", "file holding --redis-url (mode 0600, or a Secret volume's): a URL with a "
                                  "password shown by no flag or environment", "kv transfer")
    redis_password_file: str = setting("", "file holding the Redis password (mode 0600, or a Secret volume's), "
                                       "added to --redis-url", "kv transfer")
    disk_store: str = setting("", "directory of the disk KV store (shared volume in k8s)", "kv transfer")
    disk_store_max_gb: float = setting(DISK_STORE_MAX_GB, "disk store size budget in GiB", "kv transfer")
    prefix_store: str = setting("none", "persistent prefix cache in that store (located by "
                                f"{' / '.join(spec.flag for spec in STORE_SPECS.values())}): prefill "
                                "computes only blocks it lacks and writes those it computes; decode loads "
                                "matching blocks before asking for a prefill", "kv transfer",
                                choices=("none", *STORES))
    kv_offload_host_gb: float = setting(
        0.0, "host-memory tier under the KV pool, in GiB: blocks the pool evicts are copied there (pinned memory "
        "on a GPU, a second pool on CPU) and loaded back when a prompt needs them; what it evicts goes to "
        "--prefix-store (0: none)", "kv transfer")
    transfer_timeout_s: float = setting(10.0, "deadline of one transfer step", "kv transfer")
    kv_probe_cooldown_s: float = setting(5.0, "a KV backend that failed 3 times in a row is skipped this long, "
                                         "then the next transfer probes it", "kv transfer")
    prefill_timeout_s: float = setting(60.0, "decode: deadline of a remote prefill, from admission to the KV "
                                       "landing: the prefill service's queue, compute and transfer; past it "
                                       "decode follows --failure-policy", "kv transfer")
    failure_policy: str = setting(RECOMPUTE, "decode: what to do when the prefill leg fails", "kv transfer",
                                  choices=FAILURE_POLICIES)
    # -- worker: one process's own
    metrics_port: int = setting(0, "serve Prometheus /metrics on this port (0: off)", "worker")
    metrics_token: str = setting("", "the metrics port answers only 'Authorization: Bearer TOKEN' (prefer "
                                 "--metrics-token-file or PDSERVE_METRICS_TOKEN: flags show in ps; none: open)",
                                 "worker")
    metrics_token_file: str = setting("", "file holding --metrics-token (mode 0600, or a Secret volume's)", "worker")
    grpc_port: int = setting(0, "gRPC port (0 picks a free one)", "worker")  # from_settings: the role's port
    advertise_host: str = setting("", "address peers and the router use to reach this worker (none: --host)",
                                  "worker")
    router: str = setting("", "the router's registry address host:port to register with (none: do not "
                          "register)", "worker")
    worker_id: str = setting("", "stable id in the registry (none: <role>-host:port)", "worker")
    enrollment_token: str = setting("", "this worker's own enrollment token, which a router with "
                                    "--enrollment-public-key asks for at Register (prefer "
                                    "PDSERVE_ENROLLMENT_TOKEN: flags show in ps; `up` issues one per worker)",
                                    "worker")
    enrollment_token_file: str = setting("", "file holding --enrollment-token (mode 0600, or a Secret or "
                                         "memory volume's): what an enrolling init container writes", "worker")
    transfer_port: int = setting(0, "decode: UCX listener port; the NCCL/gloo store listens on the next port (0 "
                                 "picks free ones)", "worker")  # from_settings: DECODE_TRANSFER_PORT for decode
    max_queue: int = setting(64, "prefills in flight before refusing", "worker", roles=("prefill",))
    drain_timeout_s: float = setting(
        5.0, "on SIGTERM, how long the worker keeps serving what it has while routed nothing new (a decode "
        "stream still open then migrates); keep it under the 10 s a process has to stop", "lifecycle")
    core_share: str = setting(
        "", "a file through which the workers on this machine share its cores (none: no sharing); `up` "
        "sets it", "worker", roles=("decode", "prefill"))
    burst_threads: int = setting(
        0, "with --core-share: intra-op threads for a step while every other worker of the share is idle "
        "(0: --num-threads)", "worker", roles=("decode", "prefill"))
    # -- common: every process, `up` included
    host: str = setting("127.0.0.1", "address to bind listeners to", "common")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING, ERROR", "common")
    cluster_secret_file: str = security("cluster_secret_file", "")
    internal_tls_cert: str = security("internal_tls_cert", "")
    internal_tls_key: str = security("internal_tls_key", "")
    internal_tls_ca: str = security("internal_tls_ca", "")
    insecure_internal: bool = security("insecure_internal", False)


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
                values[f.name] = (repeated_values(raw) if f.metadata.get("repeated")
                                  else coerce(raw, f.default))
            except (TypeError, ValueError):
                raise SettingsError(f"--{f.name.replace('_', '-')}: cannot use {raw!r}") from None
        values.update(_key_file_values(values))
        out = cls(**values)
        if out.failure_policy not in FAILURE_POLICIES:
            raise SettingsError(f"--failure-policy must be one of {', '.join(FAILURE_POLICIES)}")
        if out.attention_window < 0:
            raise SettingsError("--attention-window must be >= 0 (0: none)")
        if out.kv_offload_host_gb < 0:
            raise SettingsError("--kv-offload-host-gb must be >= 0 (0: none)")
        if out.prefix_store not in ("none", *STORES):
            raise SettingsError(f"--prefix-store must be {', '.join(sorted(STORES))} or none")
        out.speculative()  # a malformed --speculative-config is refused here, at start
        out.lora()  # and a malformed --lora-modules entry
        spec = STORE_SPECS.get(out.prefix_store)
        if spec is not None and not getattr(out, spec.location):
            raise SettingsError(f"--prefix-store {out.prefix_store} needs {spec.flag}")
        return out

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(b.strip() for b in self.kv_backends.split(",") if b.strip())

    def transfer_config(self, secret=None):
        """The transfer layer's config (`KVTransferConfig`); its keys derive from the cluster
        `secret` (`security.secret.ClusterSecret`) when there is one."""
        from pdserve.common import envs
        from pdserve.security.secret import store_key, transfer_key

        return KVTransferConfig.from_settings(
            backends=self.kv_backends, host=self.host, transfer_port=self.transfer_port,
            redis_url=self.redis_url or None, disk_store=self.disk_store or None,
            disk_store_max_gb=self.disk_store_max_gb, step_timeout_s=self.transfer_timeout_s,
            probe_cooldown_s=self.kv_probe_cooldown_s,
            prefix_cache=self.prefix_store if self.prefix_store != "none" else None,
            host_offload_bytes=int(self.kv_offload_host_gb * 2**30),
            layerwise=envs.get("PDSERVE_KV_LAYERWISE") != "0",
            transfer_key=transfer_key(secret), store_key=store_key(secret))

    def engine_quantization(self) -> str:
        """The engine's quantization. `auto` on a prefill service is float32: its batches are
        prompts, bound by arithmetic, where float32 weights prepacked for oneDNN run about
        1.2x faster than blocks expanded per call; exact blocks compute the same KV, so it
        pairs with a decode serving them (`auto` there: the blocks of a .gguf)."""
        if self.quantization == "none" or (self.quantization == "auto" and self.role == "prefill"):
            return ""
        return self.quantization

    def thread_policy(self):
        """Who sets the engine's step thread count: the machine's core share, or None (a
        fixed --num-threads)."""
        if not self.core_share:
            return None
        import torch

        from pdserve.worker.core_share import CoreShare

        base = self.num_threads or torch.get_num_threads()
        return CoreShare(self.core_share, base, max(base, self.burst_threads or base))

    def speculative(self):
        """The engine's `SpeculativeConfig`, or None (off)."""
        from pdserve.engine.config import SpeculativeConfig

        try:
            return SpeculativeConfig.from_json(self.speculative_config)
        except InvalidRequestError as exc:
            raise SettingsError(str(exc)) from None

    def lora(self):
        """The LoRA settings (`worker.lora.LoraSettings`), validated."""
        from pdserve.worker.lora import LoraSettings

        try:
            return LoraSettings.from_worker(self)
        except InvalidRequestError as exc:
            raise SettingsError(str(exc)) from None

    def engine_config(self, secret=None):
        """The engine's config; its block-hash key derives from the cluster `secret` when
        there is one (else the public fixed key: `common.block_hash.INSECURE_KEY`)."""
        from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
        from pdserve.security.secret import block_hash_key

        return EngineConfig(
            model=self.model, dtype=self.dtype, device=self.device, seed=self.seed,
            block_hash_key=block_hash_key(secret),
            quantization=self.engine_quantization(),
            num_threads=self.num_threads or None, speculative=self.speculative(),
            cache=CacheConfig(block_size=self.block_size, max_tokens=self.max_kv_tokens or None,
                              free_memory_fraction=self.free_memory_fraction, dtype=self.dtype,
                              attention_window=self.attention_window or None),
            scheduler=SchedulerConfig(
                capacity_policy=self.capacity_policy, chunking_policy=self.chunking_policy,
                max_num_tokens=self.max_num_tokens, max_batch_size=self.max_batch_size,
                max_model_len=self.max_model_len or None),
            **self.lora().engine_fields())


