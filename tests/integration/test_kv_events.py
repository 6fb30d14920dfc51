"""KV events over real gRPC on 127.0.0.1: the router's per-worker index against what the
workers hold, after dropped events and restarts of either side; routing a returning session
to the worker holding its history after a router restart, within one event batch and well
before a heartbeat; refusal of anonymous and foreign event streams and snapshot calls.
The workers are router_fakes' (their KV event log, fanout and Snapshot service are the real
ones; a Decode call stores its prompt's blocks as a pool would)."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time

import grpc
import httpx
import pytest
from support import KeyBook

from pdserve.proto.pdserve.v1 import kv_events_pb2, kv_events_pb2_grpc, registry_pb2_grpc
from pdserve.router.app import RouterApp
from pdserve.rpc.credentials import InternalAuth, internal_channel
from pdserve.rpc.server import WORKER_MAX_RECEIVE_BYTES, internal_server
from pdserve.security.credentials import CREDENTIAL_HEADER, CallKey, CallSigner
from pdserve.security.secret import ClusterSecret
from pdserve.worker.kv_events import KV_EVENTS_SERVICE, KVEventLog, with_kv_events_service

from router_fakes import MODEL, WAIT_S, FakeWorker, wait_until, words

TIERS = ("device", "host", "disk", "redis")


def indexed(cluster, worker_id: str) -> dict[str, set[int]]:
    record = cluster.router.registry.get(worker_id)
    if record is None:
        return {}
    return {tier: set(held) for tier, held in record.kv.tiers.items() if held}


def holds(worker: FakeWorker) -> dict[str, set[int]]:
    return {tier: worker.kv.holds(tier) for tier in TIERS if worker.kv.holds(tier)}


def test_the_index_matches_the_workers_contents_after_dropped_events(make_cluster):
    cluster = make_cluster()
    d0 = cluster.add("d0", kv=KVEventLog(max_pending_events=8, batch_events=4))
    d1 = cluster.add("d1")
    rng = random.Random(3)
    for round_ in range(5):  # bursts far over d0's buffer: most of each is dropped, then a snapshot heals it
        for _ in range(200):
            worker = d0 if rng.random() < 0.7 else d1
            worker.kv.on_event(rng.choice(TIERS), rng.choice(("stored", "stored", "removed")), [rng.randrange(300)])
        for worker in (d0, d1):
            wait_until(lambda w=worker: indexed(cluster, w.worker_id) == holds(w), f"{worker.worker_id}'s index")
    assert d0.kv.num_dropped > 0 and cluster.router.registry.get("d0").kv.num_gaps > 0
    assert d1.kv.num_dropped == 0


def _restart_router(cluster) -> None:
    """Stop the router, start a new one on the same ports (a router pod restarting)."""
    old = cluster.router
    config = dataclasses.replace(old.config, http_port=old.http_port, grpc_port=old.grpc_port,
                                 registry_port=old.registry_port)

    async def restart() -> None:
        await old.stop(grace_s=0.1)
        cluster.router = RouterApp(config)
        await cluster.router.start()

    cluster.loop.run(restart(), timeout=30)


@pytest.mark.parametrize("secret", [False, True], ids=["insecure", "cluster-secret"])
def test_a_restarted_router_routes_a_returning_session_to_its_holder_within_one_batch(make_cluster, tmp_path, secret):
    """Heartbeats every 20 s: the restarted router learns of the workers from their next event
    batch (answered NOT_FOUND, or UNAUTHENTICATED where the new router has no key for them yet:
    either makes them register at once), and of what they hold from the snapshot it asks for
    at registration."""
    settings = dict(decode_policy="prefix_aware", worker_timeout_s=60.0, heartbeat_interval_s=20.0)
    signers = {}
    if secret:
        ClusterSecret.create(tmp_path / "secret")
        settings["cluster_secret_file"] = str(tmp_path / "secret")
        loaded = ClusterSecret.load(str(tmp_path / "secret"))
        signers = {name: CallSigner(loaded, name, CallKey()) for name in ("d0", "d1")}
    cluster = make_cluster(**settings)
    d0, d1 = (cluster.add(name, probe_s=0.2, signer=signers.get(name)) for name in ("d0", "d1"))
    system = words(20, start=40)
    history = [{"role": "system", "content": system}, {"role": "user", "content": words(6, start=80)}]
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        first = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 4,
                                                         "user": "session-1"}).json()
        holder_id = first["pdserve"]["routing"]["decode_worker_id"]
        holder = cluster.workers[holder_id]
        sent = holder.requests[-1].block_hashes
        wait_until(lambda: cluster.router.registry.get(holder_id).num_matched_blocks(sent) == len(sent),
                   "the first turn's blocks in the index")
        # pile the other worker's history with blocks of other sessions: the holder must win on its own
        other = d1 if holder is d0 else d0
        other.kv.on_event("device", "stored", list(range(1000, 1100)))
        _restart_router(cluster)
        started = time.monotonic()
        wait_until(lambda: cluster.router.registry.get(holder_id) is not None
                   and cluster.router.registry.get(holder_id).num_matched_blocks(sent) == len(sent)
                   and cluster.router.registry.get(other.worker_id) is not None, "the restarted router's index")
        learned_s = time.monotonic() - started
        assert learned_s < 5.0, learned_s  # a heartbeat is 20 s away
        history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": words(4, start=90)}]
        second = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 4,
                                                          "user": "session-1"}).json()
    routing = second["pdserve"]["routing"]
    assert (routing["decode_worker_id"], routing["decode_reason"]) == (holder_id, "prefix_match")
    assert routing["matched_prefix_tokens"] >= len(sent) * 4


def test_a_restarted_worker_replaces_its_index(make_cluster):
    """Same id, same address, a new process: what the old one held is forgotten, what the new
    one holds is learned."""
    cluster = make_cluster()
    d0 = cluster.add("d0")
    d0.kv.on_event("device", "stored", [1, 2, 3])
    wait_until(lambda: indexed(cluster, "d0") == {"device": {1, 2, 3}}, "the first incarnation's blocks")
    address = d0.address
    cluster.loop.run(d0.kill())
    reborn = FakeWorker(d0.role, "d0")
    reborn.kv.on_event("host", "stored", [7])

    async def up() -> None:
        await reborn.start(address=address)
        await reborn.register(cluster.registry_address)

    cluster.loop.run(up(), timeout=30)  # registers once the old registration has timed out
    cluster.workers["d0"] = reborn
    wait_until(lambda: indexed(cluster, "d0") == {"host": {7}}, "the new incarnation's blocks only")
    reborn.kv.on_event("device", "stored", [8])
    wait_until(lambda: indexed(cluster, "d0") == {"host": {7}, "device": {8}}, "events after the restart")


def test_event_streams_are_refused_unless_the_registered_worker_sends_them(make_cluster, tmp_path):
    secret_path = tmp_path / "cluster-secret"
    secret = ClusterSecret.create(secret_path)
    cluster = make_cluster(cluster_secret_file=str(secret_path))
    d0 = cluster.add("d0", signer=CallSigner(secret, "d0", CallKey()))
    cluster.add("d1", signer=CallSigner(secret, "d1", CallKey()))
    d0.kv.on_event("device", "stored", [5])
    wait_until(lambda: indexed(cluster, "d0") == {"device": {5}}, "d0's own events")
    poison = kv_events_pb2.KVEventBatch(worker_id="d0", incarnation=1, first_seq=1, events=[
        kv_events_pb2.KVEvent(tier="device", kind=kv_events_pb2.KV_EVENT_KIND_STORED, block_hashes=[666])])
    d1_signer = cluster.workers["d1"].client._signer
    method = "/pdserve.v1.Registry/PublishKVEvents"
    for metadata in ([],  # anonymous
                     [(CREDENTIAL_HEADER, CallSigner(secret, "d0").credential(method))],  # the secret's MAC: admission only
                     [(CREDENTIAL_HEADER, d1_signer.credential(method))]):  # d1 speaking for d0
        with grpc.insecure_channel(cluster.registry_address) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                registry_pb2_grpc.RegistryStub(channel).PublishKVEvents(poison, metadata=metadata, timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED

    async def own_key_without_lease() -> grpc.StatusCode:  # d0's own credential, not its lease
        async with internal_channel(cluster.registry_address, d0.client._signer) as channel:
            try:
                await registry_pb2_grpc.RegistryStub(channel).PublishKVEvents(poison, timeout=WAIT_S)
            except grpc.aio.AioRpcError as err:
                return err.code()
        return grpc.StatusCode.OK

    assert cluster.loop.run(own_key_without_lease()) == grpc.StatusCode.UNAUTHENTICATED
    assert indexed(cluster, "d0") == {"device": {5}}


def test_a_workers_snapshot_is_for_routers_only():
    secret = ClusterSecret(os.urandom(32))
    book = KeyBook(secret)
    events = KVEventLog()
    events.on_event("device", "stored", [42])

    async def run() -> None:
        auth = InternalAuth(secret)
        server = internal_server(WORKER_MAX_RECEIVE_BYTES, auth.interceptors([KV_EVENTS_SERVICE], lambda r: None, book))
        with_kv_events_service(lambda s: None, [], events)[0](server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        auth.serve_as(address)
        await server.start()
        try:
            async with internal_channel(address, book.signer("router", role="router")) as channel:
                snapshot = await kv_events_pb2_grpc.KVEventsStub(channel).Snapshot(kv_events_pb2.KVSnapshotRequest())
            assert [(t.tier, list(t.block_hashes)) for t in snapshot.tiers] == [("device", [42])]
            for signer in (None, book.signer("decode-1", role="decode")):  # anonymous; a worker
                async with (internal_channel(address, signer) if signer else grpc.aio.insecure_channel(address)) as ch:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await kv_events_pb2_grpc.KVEventsStub(ch).Snapshot(kv_events_pb2.KVSnapshotRequest(),
                                                                           timeout=WAIT_S)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await server.stop(0)

    asyncio.run(run())
