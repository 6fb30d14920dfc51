"""The process runtime of a prefill or decode service: load the engine, serve the role's
gRPC API (with health checking and reflection), register with the router, run until
SIGINT/SIGTERM, stop cleanly."""
from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import functools
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

import grpc

from pdserve.proto.pdserve.v1 import registry_pb2
from pdserve.common import progress
from pdserve.rpc.credentials import InternalAuth, InternalTLS, bind
from pdserve.worker.adapter_service import SERVICE_NAME as ADAPTERS_SERVICE, add_adapter_service
from pdserve.worker.convert import load_to_proto
from pdserve.worker.kv_events import (KV_EVENTS_SERVICE, KVEventFanout, KVEventLog, attach_kv_events,
                                      with_kv_events_service)
from pdserve.worker.lora import WorkerAdapters
from pdserve.worker.drain import DrainState, OpenCalls, drain
from pdserve.worker.registrar import Registrar
from pdserve.rpc.server import (WORKER_MAX_RECEIVE_BYTES, add_health_and_reflection, internal_server,
                                    set_serving)
from pdserve.security.secret import ClusterSecret
from pdserve.worker.settings import WorkerSettings

log = logging.getLogger("pdserve.worker")

# Once its stop begins, a worker process is gone within this many seconds: if a step of the
# stop hangs, every thread's stack goes to stderr and the process exits with status 1.
STOP_WITHIN_S = 9.0


def bind_server(settings: WorkerSettings, interceptors=(), tls: InternalTLS | None = None) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server bound to the worker's address, over mutual TLS when `tls` (servicers
    are added later)."""
    server = internal_server(WORKER_MAX_RECEIVE_BYTES, interceptors)
    port = bind(server, f"{settings.host}:{settings.grpc_port}", tls)
    if port == 0:
        raise OSError(f"{settings.role}: cannot listen for gRPC on {settings.host}:{settings.grpc_port}: "
                      "the port is in use or not allowed (--grpc-port; 0 picks a free one)")
    return server, port


async def start_serving(server: grpc.aio.Server, add_servicers, service_names: list[str]):
    """Add the servicers + health + reflection, start, mark every service (and "") SERVING.
    Returns the health servicer."""
    add_servicers(server)
    health = add_health_and_reflection(server, service_names)
    await server.start()
    await set_serving(health, service_names)
    return health


async def start_server(settings: WorkerSettings, add_servicers, service_names: list[str], interceptors=()):
    """`bind_server` + `start_serving`. Returns (server, port, health servicer)."""
    server, port = bind_server(settings, interceptors)
    return server, port, await start_serving(server, add_servicers, service_names)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _engine_busy(loop) -> bool:
    s = loop.last_stats
    return bool(s.num_waiting or s.num_running or s.num_waiting_remote)


ENGINE_CHECK_S = 0.5  # how often a worker looks whether its engine thread still runs


async def wait_for_shutdown(engine_loop=None) -> bool:
    """Until SIGINT/SIGTERM (True), or until `engine_loop`'s thread dies (False): a worker
    whose engine is gone must not stay registered, reporting its last stats for ever."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    while not stop.is_set():
        if engine_loop is not None and not engine_loop.alive:
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), ENGINE_CHECK_S)
    return True


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
    auth: InternalAuth = InternalAuth(None)  # signs this worker's outgoing internal calls
    core_share: Any = None  # worker.core_share.CoreShare: the machine's cores, shared with its other workers
    adapters: Any = None  # worker.lora.WorkerAdapters: the LoRA adapters it serves


def _with_adapters(add_role_servicers, names: list[str], adapters) -> tuple[Callable[[Any], None], list[str]]:
    """The role's servicers and the Adapters service every worker serves (LoRA administration)."""
    def add(grpc_server) -> None:
        add_role_servicers(grpc_server)
        add_adapter_service(grpc_server, adapters)

    return add, [*names, ADAPTERS_SERVICE]


def _load_report(loop, metrics, leaving: DrainState, adapters) -> Any:
    """The worker's heartbeat report (common_pb2.WorkerLoad), its metrics updated on the way."""
    metrics.observe_engine(loop.last_stats)
    report = load_to_proto(loop)
    metrics.observe_backends(report.kv_backends)
    report.counters.CopyFrom(metrics.counters(loop.last_stats))
    report.draining = leaving.draining
    report.lora_adapters.extend(adapters.states())
    return report


class ServiceBuild(Protocol):
    """What a role gives `run_worker`: its connector (before the engine exists), then its
    gRPC service (once the engine loop runs)."""

    def make_connector(self, settings: WorkerSettings, secret: ClusterSecret | None) -> Any:
        """What the engine's connector is built from: a `Connector`, or a factory the engine
        calls with its cache layout (`pdserve.engine.connector`); the transfer layer derives
        its keys from `secret`. The service finds the built one as `runtime.engine.connector`."""

    async def make_service(self, runtime: "WorkerRuntime") -> tuple[Callable[[Any], None], list[str],
                                                                  Callable[[], Awaitable[None]]]:
        """(add the servicers to a grpc.aio server, their full service names, async close)."""


def _worker_info(role: str, runtime: WorkerRuntime) -> registry_pb2.WorkerInfo:
    engine, settings = runtime.engine, runtime.settings
    return registry_pb2.WorkerInfo(
        worker_id=runtime.worker_id,
        role=registry_pb2.WORKER_ROLE_PREFILL if role == "prefill" else registry_pb2.WORKER_ROLE_DECODE,
        grpc_address=runtime.address, model_name=runtime.served_name, compatibility_hash=engine.compat_hash,
        block_size=engine.kv.block_size, kv_backends=list(settings.backends),
        capacity=registry_pb2.WorkerCapacity(
            num_total_blocks=engine.kv.get_max_resource_count(),
            max_batch_size=settings.max_batch_size, max_queue=settings.max_queue,
            max_model_len=engine.max_model_len))


async def run_worker(role: str, settings: WorkerSettings, build: ServiceBuild) -> int:
    """Load the engine with `build`'s connector, serve the role's gRPC API (with health and
    reflection), register with the router, run until SIGINT/SIGTERM, then stop cleanly:
    NOT_SERVING, deregister, stop the server, close the service, stop the engine loop."""
    from pdserve.worker.metrics import WorkerMetrics
    from pdserve.engine.engine_loop import EngineLoop
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kernels.omp import on_passing_thread

    setup_logging(settings.log_level)
    tls = InternalTLS.load(settings.internal_tls_cert, settings.internal_tls_key, settings.internal_tls_ca)
    auth = InternalAuth.from_settings(role, settings.host, settings.cluster_secret_file,
                                      settings.insecure_internal, tls)
    connector = build.make_connector(settings, auth.secret)
    core_share = settings.thread_policy()
    with progress.step(f"{role}: loading model {settings.model}"):
        engine = await on_passing_thread(functools.partial(LLMEngine, settings.engine_config(auth.secret),
                                                          connector=connector, thread_policy=core_share))
    states = engine.connector.worker.backend_states()
    log.info("%s: kv backends: %s", role, ", ".join(
        f"{b.name} ok" if b.usable else f"{b.name} off ({b.detail})" for b in states) or "none")
    served = settings.served_model_name or engine.model_name
    loop = EngineLoop(engine)
    adapters = WorkerAdapters(loop, settings.lora(), check_with=engine.model_config)  # a bad module stops the start
    loop.start(asyncio.get_running_loop())
    metrics = WorkerMetrics(role)
    metrics.watch_tiers(getattr(engine.connector, "tiers", None))  # a test's plain Connector has none
    protected = [f"pdserve.v1.{role.capitalize()}", KV_EVENTS_SERVICE, ADAPTERS_SERVICE]
    kv_events = attach_kv_events(engine, KVEventLog())
    calls, leaving = OpenCalls(), DrainState()
    server, port = bind_server(settings, (*auth.interceptors(protected, metrics.count_auth_refusal), calls), tls)
    host = settings.advertise_host or settings.host
    runtime = WorkerRuntime(settings, engine, loop, metrics, served, auth=auth, core_share=core_share,
                            address=f"{host}:{port}", worker_id=settings.worker_id or f"{role}-{host}:{port}",
                            adapters=adapters)
    auth.serve_as(runtime.address)  # signed calls to this worker name the address it registers
    add_role_servicers, names, on_close = await build.make_service(runtime)
    add_servicers, names = _with_adapters(add_role_servicers, names, adapters)
    add_servicers, names = with_kv_events_service(add_servicers, names, kv_events)
    health = await start_serving(server, add_servicers, names)
    metrics.serve(settings.host, settings.metrics_port, settings.metrics_token or None)
    info = _worker_info(role, runtime)

    load = functools.partial(_load_report, loop, metrics, leaving, adapters)
    registrar = Registrar(settings, info, load, signer=auth.signer(runtime.worker_id), tls=tls, peers=auth.peers,
                          kv_events=KVEventFanout(kv_events))
    registrar.start()
    # one line that launchers (pdserve up) and tests wait for
    print(f"pdserve {role} ready on {runtime.address} worker_id={runtime.worker_id}", flush=True)
    log.info("%s ready on %s (model %s)", role, runtime.address, served)
    code = 0
    try:
        if not await wait_for_shutdown(loop):
            log.error("%s: the engine thread died (%r); stopping so that a supervisor restarts this worker",
                      role, loop.error)
            code = 1
        elif settings.drain_timeout_s > 0:
            await drain(leaving, registrar.announce, calls, lambda: _engine_busy(loop), settings.drain_timeout_s)
            stats = loop.last_stats
            log.info("%s: drained; %d of %d KV blocks free", role, stats.num_free_blocks, stats.num_total_blocks)
    finally:
        log.info("%s shutting down", role)
        if sys.__stderr__ is not None:  # run_worker is a process's main: the watchdog ends it
            faulthandler.dump_traceback_later(STOP_WITHIN_S, exit=True, file=sys.__stderr__)
        await set_serving(health, names, serving=False)
        await registrar.stop()
        await server.stop(grace=2)
        await on_close()
        loop.stop()
        if core_share is not None:
            core_share.close()
    return code
