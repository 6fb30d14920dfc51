"""What the prefill and decode services share: typed settings, the gRPC server with health
checking and reflection (`pdserve.proto.serving`), conversions between proto and engine
types, error mapping, and registration with every router a `--router` name resolves to
(one `pdserve.proto.registry_client.RegistryClient` per address)."""
from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, fields
from typing import Any, Mapping

import grpc

from pdserve.engine.errors import (CapacityError, InvalidRequestError, ModelLoadError,
                                   PdserveError, RequestAbortedError, TransferError)
from pdserve.proto.pdserve.v1 import common_pb2, registry_pb2
from pdserve.proto.registry_client import RegistryClient
from pdserve.proto.serving import SERVER_OPTIONS, add_health_and_reflection, set_serving

log = logging.getLogger("pdserve.worker")


class SettingsError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    role: str
    model: str = "default"
    served_model_name: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: int = 0
    block_size: int = 16
    max_kv_tokens: int = 0
    free_memory_fraction: float = 0.9
    max_num_tokens: int = 2048
    max_batch_size: int = 64
    max_model_len: int = 0
    capacity_policy: str = "GUARANTEED_NO_EVICT"
    chunking_policy: str = "FIRST_COME_FIRST_SERVED"
    host: str = "127.0.0.1"
    grpc_port: int = 0
    advertise_host: str = ""
    router: str = ""
    worker_id: str = ""
    heartbeat_s: float = 2.0
    kv_backends: str = "ucx,nccl,redis,disk"
    transfer_port: int = 0
    redis_url: str = ""
    disk_store: str = ""
    disk_store_max_gb: float = 10.0
    transfer_timeout_s: float = 10.0
    prefill_timeout_s: float = 60.0
    failure_policy: str = "recompute"
    max_queue: int = 64
    local_prefill_threshold: int = 32
    prefill_queue_threshold: int = 8
    metrics_port: int = 0
    log_level: str = "INFO"

    @classmethod
    def from_settings(cls, role: str, settings: Mapping[str, Any]) -> "WorkerSettings":
        """Typed from the CLI's merged dict (values from env/YAML may be strings)."""
        values: dict[str, Any] = {"role": role}
        for f in fields(cls):
            if f.name == "role" or settings.get(f.name) is None:
                continue
            raw = settings[f.name]
            try:
                values[f.name] = _coerce(raw, type(getattr(cls, f.name)) if hasattr(cls, f.name) else str, f.default)
            except (TypeError, ValueError):
                raise SettingsError(f"--{f.name.replace('_', '-')}: cannot use {raw!r}") from None
        out = cls(**values)
        if out.failure_policy not in ("recompute", "fail"):
            raise SettingsError("--failure-policy must be recompute or fail")
        return out

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(b.strip() for b in self.kv_backends.split(",") if b.strip())

    def engine_config(self):
        from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

        return EngineConfig(
            model=self.model, dtype=self.dtype, device=self.device,
            num_threads=self.num_threads or None,
            cache=CacheConfig(block_size=self.block_size, max_tokens=self.max_kv_tokens or None,
                              free_memory_fraction=self.free_memory_fraction, dtype=self.dtype),
            scheduler=SchedulerConfig(
                capacity_policy=self.capacity_policy, chunking_policy=self.chunking_policy,
                max_num_tokens=self.max_num_tokens, max_batch_size=self.max_batch_size,
                max_model_len=self.max_model_len or None))


def _coerce(raw: Any, kind: type, default: Any) -> Any:
    if isinstance(default, bool):
        return raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return str(raw)


# -- conversions ---------------------------------------------------------------------------
def sampling_from_proto(p: common_pb2.SamplingParams):
    from pdserve.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=int(p.max_tokens) if p.HasField("max_tokens") else 16,
        min_tokens=int(p.min_tokens),
        temperature=float(p.temperature) if p.HasField("temperature") else 1.0,
        top_p=float(p.top_p) if p.HasField("top_p") else 1.0,
        top_k=int(p.top_k) if p.HasField("top_k") else 0,
        seed=int(p.seed) if p.HasField("seed") else None,
        stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
        logprobs=(int(p.top_logprobs) if p.logprobs else None))


def logprob_to_proto(lp, tokenizer=None) -> common_pb2.TokenLogprob:
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else ""

    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, token=text(lp.token_id),
        top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=v, token=text(t)) for t, v in lp.top])


def logprob_from_proto(p: common_pb2.TokenLogprob):
    from pdserve.engine.request import TokenLogprob

    return TokenLogprob(p.token_id, p.logprob, tuple((t.token_id, t.logprob) for t in p.top_logprobs))


def model_info(engine, served_name: str, include_tokenizer: bool) -> common_pb2.ModelInfoResponse:
    tok = engine.tokenizer
    resp = common_pb2.ModelInfoResponse(
        model_name=served_name, max_model_len=engine.max_model_len, block_size=engine.kv.block_size,
        block_hash_salt=engine.compat_hash, eos_token_ids=list(engine.model_config.eos_token_ids),
        vocab_size=engine.model_config.vocab_size)
    if tok is not None:
        resp.chat_template = getattr(tok, "chat_template", None) or ""
        resp.bos_token = tok.bos_token or ""
        resp.eos_token = tok.eos_token or ""
        for key, value in (tok.special_tokens_map or {}).items():
            if isinstance(value, str):
                resp.special_tokens[key] = value
        resp.additional_special_tokens.extend(
            [t for t in (getattr(tok, "additional_special_tokens", None) or []) if isinstance(t, str)])
        if include_tokenizer:
            resp.tokenizer_json = tok.backend_tokenizer.to_str().encode()
    return resp


def load_to_proto(engine_loop, num_queued_extra: int = 0, max_hashes: int = 4096) -> common_pb2.WorkerLoad:
    s = engine_loop.last_stats
    hashes = engine_loop.engine.kv.pool.cached_hashes()[-max_hashes:]
    return common_pb2.WorkerLoad(
        num_queued=s.num_waiting + num_queued_extra, num_running=s.num_running + s.num_waiting_remote,
        num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
        cached_block_hashes=list(reversed(hashes)))


# -- errors --------------------------------------------------------------------------------
def status_of(exc: BaseException) -> grpc.StatusCode:
    """The one mapping from our typed errors to gRPC status codes."""
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, RequestAbortedError):
        return grpc.StatusCode.CANCELLED
    if isinstance(exc, (TransferError, ModelLoadError)):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, PdserveError):
        return grpc.StatusCode.INTERNAL
    return grpc.StatusCode.INTERNAL


# -- the server ----------------------------------------------------------------------------
async def start_server(settings: WorkerSettings, add_servicers, service_names: list[str]):
    """A grpc.aio server with our servicers + health + reflection, every service (and "")
    SERVING once it listens. Returns (server, port, health servicer)."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_servicers(server)
    health = add_health_and_reflection(server, service_names)
    port = server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
    if port == 0:
        raise OSError(f"cannot bind {settings.host}:{settings.grpc_port}")
    await server.start()
    await set_serving(health, service_names)
    return server, port, health


# -- registration with the router ----------------------------------------------------------
def router_addresses(target: str) -> set[str]:
    """Every "host:port" that `target` resolves to (a Kubernetes headless Service lists each
    router pod); `target` itself when it does not resolve. IPv6 hosts come back bracketed."""
    import socket

    host, _, port = target.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return {target}
    addrs = {f"[{i[4][0]}]:{port}" if ":" in i[4][0] else f"{i[4][0]}:{port}" for i in infos}
    return addrs or {target}


class Registrar:
    """Keeps this worker registered with every router while the service runs.

    `--router host:port` may name several routers: the name is resolved every
    `resolve_every_s`, each resolved address gets its own `RegistryClient` (register,
    heartbeat, re-register on NOT_FOUND, deregister on stop), and an address that no longer
    resolves has its client stopped without deregistering (that router is gone or not ready).
    """

    def __init__(self, settings: WorkerSettings, info: registry_pb2.WorkerInfo, load_fn,
                 *, resolve_every_s: float = 15.0) -> None:
        self.settings = settings
        self.info = info
        self.load_fn = load_fn
        self.resolve_every_s = resolve_every_s
        self._task: asyncio.Task | None = None
        self._clients: dict[str, RegistryClient] = {}

    @property
    def addresses(self) -> tuple[str, ...]:
        """The router addresses that currently have a client."""
        return tuple(sorted(self._clients))

    @property
    def registered(self) -> bool:
        """Registered with at least one router."""
        return any(c.registered for c in self._clients.values())

    def start(self) -> None:
        if self.settings.router:
            self._task = asyncio.create_task(self._resolve_forever())

    async def wait_registered(self, timeout_s: float) -> None:
        """TimeoutError unless some router accepted us within `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            while not self.registered:
                await asyncio.sleep(0.05)

    def _client(self, address: str) -> RegistryClient:
        heartbeat_s = self.settings.heartbeat_s
        return RegistryClient(address, self.info, self.load_fn, heartbeat_s=heartbeat_s,
                              retry_s=min(0.5, heartbeat_s), max_retry_s=heartbeat_s,
                              rpc_timeout_s=5.0, register_timeout_s=10.0)

    async def _resolve_forever(self) -> None:
        while True:
            addrs = await asyncio.to_thread(router_addresses, self.settings.router)
            for addr in sorted(addrs - set(self._clients)):
                client = self._clients[addr] = self._client(addr)
                client.start()
            for addr in set(self._clients) - addrs:
                await self._clients.pop(addr).stop(deregister=False)
            await asyncio.sleep(self.resolve_every_s)

    async def stop(self) -> None:
        """Stop resolving, deregister from every router (best effort, in parallel)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.stop() for c in clients))


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def wait_for_shutdown() -> None:
    """Until SIGINT/SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    await stop.wait()


@dataclass(slots=True)
class WorkerRuntime:
    """What a running worker holds; built by `run_worker`, used by the role's servicer."""

    settings: WorkerSettings
    engine: Any
    loop: Any  # EngineLoop
    metrics: Any  # WorkerMetrics
    served_name: str
    worker_id: str = ""
    address: str = ""


async def run_worker(role: str, settings: WorkerSettings, build) -> int:
    """Load the engine, serve the role's gRPC API, register with the router, run until
    SIGINT/SIGTERM, then stop cleanly. `build(runtime, connector_holder)` returns
    (add_servicers, service_names, on_close) and may swap in a connector before the engine
    starts via `make_connector(settings) -> Connector`."""
    from pdserve.deploy.metrics import WorkerMetrics
    from pdserve.engine.engine_loop import EngineLoop
    from pdserve.engine.llm_engine import LLMEngine

    setup_logging(settings.log_level)
    connector = build.make_connector(settings)
    engine = await asyncio.to_thread(LLMEngine, settings.engine_config(), connector=connector)
    served = settings.served_model_name or engine.model_name
    loop = EngineLoop(engine)
    loop.start(asyncio.get_running_loop())
    metrics = WorkerMetrics(role)
    runtime = WorkerRuntime(settings, engine, loop, metrics, served)
    add_servicers, names, on_close = await build.make_service(runtime)
    server, port, health = await start_server(settings, add_servicers, names)
    host = settings.advertise_host or settings.host
    runtime.address = f"{host}:{port}"
    runtime.worker_id = settings.worker_id or f"{role}-{host}:{port}"
    metrics.serve(settings.host, settings.metrics_port)
    info = registry_pb2.WorkerInfo(
        worker_id=runtime.worker_id,
        role=registry_pb2.WORKER_ROLE_PREFILL if role == "prefill" else registry_pb2.WORKER_ROLE_DECODE,
        grpc_address=runtime.address, model_name=served, compatibility_hash=engine.compat_hash,
        block_size=engine.kv.block_size, kv_backends=list(settings.backends),
        capacity=registry_pb2.WorkerCapacity(
            num_total_blocks=engine.kv.get_max_resource_count(),
            max_batch_size=settings.max_batch_size, max_queue=settings.max_queue,
            max_model_len=engine.max_model_len))

    def load():
        metrics.observe_engine(loop.last_stats)
        return load_to_proto(loop)

    registrar = Registrar(settings, info, load)
    registrar.start()
    # one line that launchers (pdserve up) and tests wait for
    print(f"pdserve {role} ready on {runtime.address} worker_id={runtime.worker_id}", flush=True)
    log.info("%s ready on %s (model %s)", role, runtime.address, served)
    try:
        await wait_for_shutdown()
    finally:
        log.info("%s shutting down", role)
        await set_serving(health, names, serving=False)
        await registrar.stop()
        await server.stop(grace=2)
        await on_close()
        loop.stop()
    return 0
