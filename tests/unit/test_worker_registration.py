"""A worker staying registered with the router, against the router's real Registry servicer
on a real grpc.aio server (127.0.0.1): `Registrar` resolves `--router` and keeps one
`RegistryClient` per address (register, heartbeat, re-register on NOT_FOUND, deregister on
stop); `start_server` serves health ("" and each service) and reflection."""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.worker.registrar import Registrar, router_addresses
from pdserve.worker.runtime import start_server
from pdserve.worker.settings import WorkerSettings
from pdserve.proto.pdserve.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from pdserve.worker.registry_client import RegistryClient
from pdserve.rpc.server import service_name, set_serving
from pdserve.router.catalog import ModelCatalog
from pdserve.rpc.channels import WorkerChannels
from pdserve.router.config import RouterConfig
from pdserve.router.grpc_api import RegistryServicer
from pdserve.router.dispatch import BackgroundTasks
from pdserve.router.kv_index import KVEventIntake
from pdserve.router.membership import Membership
from pdserve.router.worker_registry import WorkerRegistry

WAIT_S = 5.0  # every wait here ends by then
HEARTBEAT_S = 0.1  # what the router asks for
WORKER_ID = "prefill-test"


async def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        await asyncio.sleep(0.02)


@dataclass
class Router:
    """The router's registry side only: Registry servicer -> Membership -> WorkerRegistry."""

    registry: WorkerRegistry
    server: grpc.aio.Server
    port: int


async def start_router(bind: str = "127.0.0.1:0") -> Router:
    config = RouterConfig(http_port=0, grpc_port=0, heartbeat_interval_s=HEARTBEAT_S, worker_timeout_s=WAIT_S)
    registry = WorkerRegistry(config.worker_timeout_s)
    channels = WorkerChannels()
    kv_events = KVEventIntake.for_registry(registry, channels, BackgroundTasks().spawn, WAIT_S)
    membership = Membership(config, registry, ModelCatalog(), channels, kv_events.sync)
    server = grpc.aio.server()
    registry_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(membership, config, kv_events), server)
    port = server.add_insecure_port(bind)
    await server.start()
    return Router(registry, server, port)


@pytest.fixture
async def router():
    r = await start_router()
    yield r
    await r.server.stop(0)


def worker_info() -> registry_pb2.WorkerInfo:
    # a prefill worker: the router registers it without calling back for ModelInfo
    return registry_pb2.WorkerInfo(worker_id=WORKER_ID, role=registry_pb2.WORKER_ROLE_PREFILL,
                                   grpc_address="127.0.0.1:1", model_name="tiny", block_size=4,
                                   capacity=registry_pb2.WorkerCapacity(num_total_blocks=8))


def counting_load() -> Callable[[], common_pb2.WorkerLoad]:
    """Each report carries a new num_queued, so the router's record shows fresh reports."""
    count = itertools.count()
    return lambda: common_pb2.WorkerLoad(num_queued=next(count), num_free_blocks=8, num_total_blocks=8)


def registrar(target: str) -> Registrar:
    settings = WorkerSettings(role="prefill", router=target, heartbeat_s=HEARTBEAT_S)
    return Registrar(settings, worker_info(), counting_load())


async def test_registers_heartbeats_registers_again_after_not_found_and_deregisters(router):
    target = f"127.0.0.1:{router.port}"
    r = registrar(target)
    r.start()
    try:
        await r.wait_registered(WAIT_S)
        assert r.addresses == (target,)
        first = router.registry.get(WORKER_ID)
        assert first is not None and first.worker.model_name == "tiny"

        reported = first.load.num_queued
        await eventually(lambda: router.registry.get(WORKER_ID).load.num_queued >= reported + 2,
                         "two heartbeats with fresh load")

        router.registry.deregister(WORKER_ID)  # as if the router restarted or declared us dead
        await eventually(lambda: router.registry.get(WORKER_ID) is not None,
                         "registered again after the heartbeat was answered NOT_FOUND")
    finally:
        await r.stop()
    assert router.registry.get(WORKER_ID) is None, "stop() deregisters"
    assert not r.registered and r.addresses == ()


async def test_a_failing_load_report_does_not_stop_the_heartbeats(router, caplog):
    fresh = counting_load()
    calls = itertools.count()

    def flaky():  # every other report raises
        if next(calls) % 2:
            raise RuntimeError("engine stats unavailable")
        return fresh()

    client = RegistryClient(f"127.0.0.1:{router.port}", worker_info(), flaky, heartbeat_s=HEARTBEAT_S)
    client.start()
    try:
        await client.wait_registered(WAIT_S)
        reported = router.registry.get(WORKER_ID).load.num_queued
        await eventually(lambda: router.registry.get(WORKER_ID).load.num_queued >= reported + 2,
                         "fresh reports keep arriving between failing ones")
    finally:
        await client.stop()
    assert "engine stats unavailable" in caplog.text


async def test_heartbeat_interval_is_the_shorter_of_the_workers_and_the_routers(router):
    # the router asks for HEARTBEAT_S (0.1 s)
    slow = RegistryClient(f"127.0.0.1:{router.port}", worker_info(), counting_load(), heartbeat_s=5.0)
    fast = RegistryClient(f"127.0.0.1:{router.port}", worker_info(), counting_load(), heartbeat_s=0.05)
    for client, expected in ((slow, HEARTBEAT_S), (fast, 0.05)):
        client.start()
        try:
            await client.wait_registered(WAIT_S)
            assert client.interval_s == pytest.approx(expected)
        finally:
            await client.stop()


async def test_a_router_name_gets_one_client_per_address():
    r_router = await start_router("localhost:0")  # every address localhost resolves to, one port
    target = f"localhost:{r_router.port}"
    r = registrar(target)
    r.start()
    try:
        await r.wait_registered(WAIT_S)
        assert set(r.addresses) == router_addresses(target)
        assert r_router.registry.get(WORKER_ID) is not None
    finally:
        await r.stop()
        await r_router.server.stop(0)
    assert r_router.registry.get(WORKER_ID) is None


def test_router_addresses():
    assert router_addresses("127.0.0.1:50050") == {"127.0.0.1:50050"}
    assert router_addresses("[::1]:50050") == {"[::1]:50050"}
    assert router_addresses("no-such-host.invalid:50050") == {"no-such-host.invalid:50050"}
    assert router_addresses("localhost:50050") <= {"127.0.0.1:50050", "[::1]:50050"}


async def test_client_registers_once_the_router_comes_up(free_port):
    client = RegistryClient(f"127.0.0.1:{free_port}", worker_info(), counting_load(),
                            retry_s=0.05, max_retry_s=0.2, rpc_timeout_s=1.0)
    client.start()
    late = None
    try:
        await eventually(lambda: client.num_refused >= 3, "a few refused attempts")
        assert not client.registered
        late = await start_router(f"127.0.0.1:{free_port}")
        await client.wait_registered(WAIT_S)
        assert late.registry.get(WORKER_ID) is not None
    finally:
        await client.stop()
        if late is not None:
            await late.server.stop(0)


async def test_start_server_serves_health_and_reflection():
    names = [service_name(registry_pb2, "Registry")]
    settings = WorkerSettings(role="decode", host="127.0.0.1", grpc_port=0)
    server, port, health = await start_server(settings, lambda s: None, names)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            for name in ("", *names):
                answer = await check(health_pb2.HealthCheckRequest(service=name), timeout=WAIT_S)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING, name

            reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo
            listed = [r async for r in reflect(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               timeout=WAIT_S)]
            listed_names = {s.name for s in listed[0].list_services_response.service}
            assert {*names, "grpc.health.v1.Health"} <= listed_names

            await set_serving(health, names, serving=False)  # what run_worker does on shutdown
            answer = await check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await server.stop(0)
