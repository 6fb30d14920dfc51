"""The router process's parts, wired together, and its listeners in one event loop: HTTP
(uvicorn + FastAPI) and gRPC Generation for clients, and gRPC Registry for workers on a port
of its own (with the cluster secret, every Registry call must carry a credential).

    app = RouterApp(RouterConfig(http_port=0, grpc_port=0, registry_port=0))
    await app.start()      # app.http_port / app.grpc_port / app.registry_port are the bound ports
    ...
    await app.stop()
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import socket
import time
from typing import Iterator

import grpc
import uvicorn

from pdserve.proto.pdserve.v1 import generation_pb2, generation_pb2_grpc, registry_pb2, registry_pb2_grpc
from pdserve.rpc.credentials import InternalAuth, InternalTLS
from pdserve.rpc.server import (REGISTRY_MAX_RECEIVE_BYTES, MalformedRequestInterceptor, add_health_and_reflection,
                                internal_server, server_options, service_name, set_serving)
from pdserve.router.admission import InFlight
from pdserve.router.api_key import ApiKeyInterceptor, client_keys, metrics_bearer
from pdserve.router.enrollment import Revocations, enrollment_verifier
from pdserve.router.http_guard import guarded_protocol
from pdserve.router.catalog import ModelCatalog
from pdserve.rpc.channels import WorkerChannels
from pdserve.router.config import ConfigError, RouterConfig
from pdserve.router.dispatch import BackgroundTasks, DecodeClient
from pdserve.router.frontend import Frontend
from pdserve.router.grpc_api import GenerationServicer, RegistryServicer
from pdserve.router.adapters import AdapterAdmin, AdapterDirectory
from pdserve.router.http_api import build_http_app
from pdserve.router.link_probes import LinkProbes
from pdserve.router.kv_index import KVEventIntake
from pdserve.router.membership import Membership
from pdserve.router.metrics import RouterMetrics
from pdserve.router.planner import RoutePlanner
from pdserve.router.guided import GuidedOptions
from pdserve.router.policies import make_policy
from pdserve.router.worker_registry import RegistryKeys, WorkerRegistry
from pdserve.security.secret import block_hash_key

log = logging.getLogger("pdserve.router")

_GENERATION = service_name(generation_pb2, "Generation")
_REGISTRY = service_name(registry_pb2, "Registry")
# Client calls beyond the queue bound: Generate calls the queue refuses, Abort, ModelInfo and
# health checks keep answering while the queue is full.
CONTROL_CALLS = 64


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside our event loop: the router process owns the signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class RouterApp:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.registry = WorkerRegistry(config.worker_timeout_s, config.max_indexed_blocks_per_worker,
                                       check_claims=config.check_prefix_claims)
        self.metrics = RouterMetrics(self.registry)
        self.catalog = ModelCatalog()
        tls = InternalTLS.load(config.internal_tls_cert, config.internal_tls_key, config.internal_tls_ca)
        self.auth = InternalAuth.from_settings("router", config.host, config.cluster_secret_file,
                                               config.insecure_internal, tls)
        if self.auth.enabled and config.static_workers:
            # a worker verifies the router's calls with the key it learns when it registers
            raise ConfigError("--static-workers cannot be used with a cluster secret: workers must register "
                              "(--router on each worker) to learn the key the router signs its calls with")
        self.channels = WorkerChannels(self.auth.signer("router"), tls)
        self.tasks = BackgroundTasks()
        self.in_flight = InFlight(config.max_queue, config.retry_after_s)
        self.metrics.in_flight.set_function(lambda: len(self.in_flight))
        planner = RoutePlanner(self.registry, make_policy(config.decode_policy), make_policy(config.prefill_policy),
                               config.local_prefill_threshold, config.prefill_queue_threshold,
                               self.metrics, predict=not config.static_routing,
                               probes=LinkProbes(config.link_probe_interval_s))
        self.decode = DecodeClient(self.channels, self.registry, self.tasks, config.stream_idle_timeout_s,
                                   config.rpc_timeout_s)
        self.frontend = Frontend(self.catalog, planner, self.decode, self.in_flight, self.metrics,
                                 max_migrations=config.max_migrations,
                                 guided=GuidedOptions(config.lenient_json_schema),
                                 block_hash_key=block_hash_key(self.auth.secret),
                                 adapters=AdapterDirectory(self.registry))
        self.adapter_admin = AdapterAdmin(self.registry, self.channels, config.enable_lora)
        self.kv_events = KVEventIntake.for_registry(self.registry, self.channels, self.tasks.spawn,
                                                    config.rpc_timeout_s)
        self.membership = Membership(config, self.registry, self.catalog, self.channels, self.kv_events.sync)
        self.api_key = client_keys(config)
        self.enrollment = enrollment_verifier(config)
        self.revocations = (Revocations(config.revoked_workers_file, self.enrollment, self.registry)
                            if config.revoked_workers_file else None)
        self.http_port = 0
        self.grpc_port = 0
        self.registry_port = 0
        self._grpc_server: grpc.aio.Server | None = None
        self._registry_server: grpc.aio.Server | None = None
        self._http_server: _EmbeddedUvicorn | None = None
        self._http_task: asyncio.Task | None = None
        self._poller: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._metrics_server = None

    async def start(self) -> None:
        await self._start_grpc()
        await self._start_http()
        self._watch = asyncio.get_running_loop().create_task(self._cut_off_dead_workers())
        if self.config.static_workers:
            self._poller = asyncio.get_running_loop().create_task(self.membership.poll_static_workers())
        if self.config.metrics_port:  # the bearer HTTP /metrics asks for (`metrics_bearer`)
            from prometheus_client import generate_latest

            from pdserve.common.metrics_http import MetricsServer

            self._metrics_server = MetricsServer(self.config.host, self.config.metrics_port,
                                                 lambda: generate_latest(self.metrics.registry),
                                                 metrics_bearer(self.config))
        log.info("router serving HTTP on http://%s:%d, gRPC on %s:%d, the worker registry on %s:%d",
                 self.config.host, self.http_port, self.config.host, self.grpc_port, self.config.host,
                 self.registry_port)

    async def _cut_off_dead_workers(self) -> None:
        """Streams open to a worker the registry declares dead end at once (and migrate).
        Every TRIM_EVERY_S, freed heap goes back to the OS."""
        period = min(1.0, self.config.worker_timeout_s / 4)
        trimmed = time.monotonic()
        while True:
            await asyncio.sleep(period)
            self.registry.forget_silent()
            if self.revocations is not None:
                self.revocations.poll()
            if ended := self.decode.cut_off_dead():
                log.warning("ended %d streams open to dead decode workers", ended)
            if time.monotonic() - trimmed >= TRIM_EVERY_S:
                trimmed = time.monotonic()
                await asyncio.to_thread(_give_back_freed_memory)

    async def stop(self, grace_s: float = 2.0) -> None:
        for task in (self._poller, self._watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._http_server is not None and self._http_task is not None:
            self._http_server.should_exit = True
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._http_task, grace_s + 3.0)
        for server in (self._grpc_server, self._registry_server):
            if server is not None:
                await server.stop(grace_s)
        await self.tasks.drain(grace_s)
        await self.channels.close()
        self.frontend.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()

    async def _start_grpc(self) -> None:
        # The client port reads nothing of a call before its API key (ApiKeyInterceptor), takes
        # no message larger than an HTTP body may be, keeps HTTP/2 windows at their initial
        # size (server_options) and runs at most max_queue + CONTROL_CALLS calls at once: more
        # get RESOURCE_EXHAUSTED unread.
        refused = functools.partial(self.frontend.count_rejected, "grpc")
        server = grpc.aio.server(options=server_options(self.config.max_body_bytes),
                                 interceptors=[ApiKeyInterceptor(self.api_key, [_GENERATION], refused),
                                               MalformedRequestInterceptor()],
                                 maximum_concurrent_rpcs=self.config.max_queue + CONTROL_CALLS)
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(self.frontend, self.catalog,
                                                                                self.api_key), server)
        self._grpc_server, self.grpc_port = await _serve(server, self.config.host, self.config.grpc_port, _GENERATION,
                                                         "the client API (gRPC)", _tls_credentials(self.config))
        interceptors = self.auth.interceptors([_REGISTRY], self.metrics.count_auth_refusal, RegistryKeys(self.registry))
        registry = internal_server(REGISTRY_MAX_RECEIVE_BYTES, interceptors)
        registry_pb2_grpc.add_RegistryServicer_to_server(
            RegistryServicer(self.membership, self.config, self.kv_events, authenticated=self.auth.enabled,
                             public_key=self.auth.public_key, enrollment=self.enrollment), registry)
        self._registry_server, self.registry_port = await _serve(
            registry, self.config.internal_host or self.config.host, self.config.registry_port, _REGISTRY,
            "the worker registry",
            self.auth.tls.server_credentials() if self.auth.tls else None)

    async def _start_http(self) -> None:
        app = build_http_app(self.frontend, self.catalog, self.registry, self.metrics, self.config, self.api_key,
                             self.adapter_admin)
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.http_port))
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"router: cannot listen for HTTP on {self.config.host}:{self.config.http_port}: "
                                     f"{exc.strerror} (--http-port; `pdserve up --port`)") from None
        sock.listen(1024)
        sock.setblocking(False)
        self.http_port = sock.getsockname()[1]
        server = _EmbeddedUvicorn(uvicorn.Config(app, log_level=self.config.log_level.lower(), access_log=False,
                                                 lifespan="off", http=guarded_protocol(self.config.http_limits),
                                                 ws="none", timeout_keep_alive=self.config.http_idle_timeout_s,
                                                 timeout_graceful_shutdown=2,
                                                 ssl_certfile=self.config.tls_cert or None,
                                                 ssl_keyfile=self.config.tls_key or None))
        self._http_task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        self._http_server = server
        deadline = asyncio.get_running_loop().time() + 30.0
        while not server.started:
            if self._http_task.done():
                self._http_task.result()
                raise OSError("HTTP server stopped during startup")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("HTTP server did not start within 30 s")
            await asyncio.sleep(0.01)


TRIM_EVERY_S = 10.0


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return None


def _give_back_freed_memory() -> None:
    """glibc keeps freed heap in its arenas: after a burst of large request bodies the
    router's RSS would stay at its peak for good. malloc_trim hands it back."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _tls_credentials(config: RouterConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert:
        return None
    with open(config.tls_key, "rb") as key, open(config.tls_cert, "rb") as cert:
        return grpc.ssl_server_credentials([(key.read(), cert.read())])


async def _serve(server: grpc.aio.Server, host: str, port: int, service: str, what: str,
                 credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.aio.Server, int]:
    """Bind (with TLS when given credentials), add health + reflection, start, mark SERVING.
    Returns (server, bound port)."""
    health = add_health_and_reflection(server, (service,))
    address = _join(host, port)
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind"
        bound = 0
    if bound == 0:
        raise OSError(f"router: cannot listen for {what} on {host}:{port}: the port is in use or not allowed")
    await server.start()
    await set_serving(health, (service,))
    return server, bound


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
