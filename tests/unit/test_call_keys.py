"""Per-process call keys (issue 38, item 1): v2 credentials verify only with the caller's own
key, v1 ones only admit; a worker's directory of keys (PeerKeys); the registry binds an id
to its key."""
from __future__ import annotations

import asyncio

import pytest
from support import FakeClock, KeyBook

from pdserve.common.errors import AuthError
from pdserve.common.errors import AlreadyExistsError
from pdserve.router.config import Role
from pdserve.router.worker_registry import Load, RegistryKeys, Worker, WorkerRegistry
from pdserve.security.credentials import (ADMISSION_METHODS, CallKey, CallSigner, CallVerifier, Identity,
                                          UnknownCallerError)
from pdserve.security.key_directory import PeerKeys
from pdserve.security.secret import ClusterSecret

METHOD = "/pdserve.v1.Decode/Decode"
REGISTER = "/pdserve.v1.Registry/Register"


@pytest.fixture
def secret() -> ClusterSecret:
    return ClusterSecret(b"k" * 32)


def test_a_signed_credential_verifies_only_with_its_callers_key(secret):
    clock = FakeClock(1_000_000.0)
    book = KeyBook(secret, role="router")
    signer = book.signer("router", clock=clock)
    verifier = CallVerifier(secret, book, max_skew_s=30, clock=clock)
    credential = signer.credential(METHOD)
    assert credential.startswith("v2 router ")
    assert verifier.check(METHOD, credential) == Identity("router", "router", signer.public_key)
    with pytest.raises(AuthError, match="replayed"):
        verifier.verify(METHOD, credential)
    with pytest.raises(UnknownCallerError):  # bound to the method
        verifier.verify("/pdserve.v1.Decode/Abort", signer.credential(METHOD))
    forged = CallSigner(secret, "router", CallKey(), clock=clock)  # the secret and a key of its own
    with pytest.raises(UnknownCallerError, match="no key known here") as caught:
        verifier.verify(METHOD, forged.credential(METHOD))
    assert caught.value.caller_id == "router"
    parts = signer.credential(METHOD).split(" ")
    parts[1] = "decode-0"  # renamed inside a valid credential
    with pytest.raises(AuthError):
        verifier.verify(METHOD, " ".join(parts))
    stale = signer.credential(METHOD)
    clock.now += 31
    with pytest.raises(AuthError, match="skew"):
        verifier.verify(METHOD, stale)


def test_a_secret_credential_only_admits(secret):
    book = KeyBook(secret)
    verifier = CallVerifier(secret, book)
    admission = CallSigner(secret, "anyone")  # no key: v1 for every method
    for method in sorted(ADMISSION_METHODS):
        assert verifier.verify(method, admission.credential(method)) == "anyone"
    with pytest.raises(AuthError, match="own signature"):
        verifier.verify(METHOD, admission.credential(METHOD))
    keyed = book.signer("decode-0")
    assert keyed.credential(REGISTER).startswith("v1 ")  # Register: the router has no key of it yet
    assert keyed.credential(METHOD).startswith("v2 ")
    with pytest.raises(AuthError, match="malformed"):  # no directory: no signature can verify
        CallVerifier(secret).verify(METHOD, keyed.credential(METHOD))
    assert "CallKey(public=" in repr(CallKey())


def test_peer_keys_know_routers_and_look_peers_up_at_a_bounded_rate():
    clock = FakeClock(100.0)
    peers = PeerKeys(ttl_s=30, min_refresh_s=1, clock=clock)
    keys = {"decode-0": CallKey().public_key}
    asked: list[str] = []

    async def lookup(worker_id: str):
        asked.append(worker_id)
        await asyncio.sleep(0)  # a lookup in flight: the other refreshes run meanwhile
        return Identity(worker_id, "decode", keys[worker_id]) if worker_id in keys else None

    async def scenario() -> None:
        assert peers.identities("router") == []
        waiting = asyncio.ensure_future(peers.refresh("router"))  # a router calls before its answer arrived
        await asyncio.sleep(0)  # it starts waiting
        peers.set_router("r:1", b"R" * 32, lookup)
        await asyncio.wait_for(waiting, 1)
        assert [i.public_key for i in peers.identities("router")] == [b"R" * 32]
        await asyncio.gather(*(peers.refresh("decode-0") for _ in range(5)))  # one lookup for all
        assert asked == ["decode-0"] and peers.identities("decode-0")[0].public_key == keys["decode-0"]
        await peers.refresh("decode-0")  # asked moments ago: not again
        assert asked == ["decode-0"]
        keys["decode-0"] = CallKey().public_key  # restarted with a new key
        clock.now += 1.5
        await peers.refresh("decode-0")
        assert peers.identities("decode-0")[0].public_key == keys["decode-0"]
        clock.now += 31  # past its TTL: unknown until asked again
        assert peers.identities("decode-0") == ()
        await peers.refresh("nobody")
        assert peers.identities("nobody") == () and asked[-1] == "nobody"
        peers.forget_router("r:1")
        assert peers.identities("router") == []
        await peers.refresh("decode-1")  # no registry to ask
        assert asked[-1] == "nobody"

    asyncio.run(scenario())


def test_the_registry_binds_a_live_id_to_its_key():
    clock = FakeClock()
    registry = WorkerRegistry(worker_timeout_s=5.0, clock=clock)
    worker = Worker("d0", Role.DECODE, "h:1", "m")
    key, other = CallKey().public_key, CallKey().public_key
    lease = registry.register(worker, Load(), leased=True, public_key=key)
    keys = RegistryKeys(registry)
    assert keys.identities("d0") == (Identity("d0", "decode", key),) and keys.identities("d1") == ()
    with pytest.raises(AlreadyExistsError, match="another key"):  # even with the lease
        registry.check_free(worker, lease, other)
    with pytest.raises(AlreadyExistsError, match="is live worker 'd0'"):  # its address is taken too
        registry.check_free(Worker("d1", Role.DECODE, "h:1", "m"), b"", other)
    registry.check_free(worker, lease, key)  # its own registration again: fine
    clock.now += 6  # dead: the id (and address) are free again, for any key
    registry.check_free(worker, b"", other)
    assert keys.identities("d0")[0].public_key == key  # until re-registered or forgotten


def test_a_router_credential_waits_only_for_a_registration_in_flight():
    peers = PeerKeys(router_wait_s=5.0, max_router_waits=2)

    async def lookup(worker_id: str):
        return None

    async def scenario() -> None:
        peers.set_router("r:1", b"A" * 32, lookup)
        await asyncio.wait_for(peers.refresh("router"), 0.5)  # a key is known, nothing in flight: at once
        peers.registering("r:1", True)  # the router restarted; we register again
        waits = [asyncio.ensure_future(peers.refresh("router")) for _ in range(3)]
        await asyncio.wait(waits, timeout=1, return_when=asyncio.FIRST_COMPLETED)
        assert sum(w.done() for w in waits) == 1  # beyond max_router_waits: refused at once
        peers.registering("r:1", False)
        peers.set_router("r:1", b"B" * 32, lookup)
        await asyncio.wait_for(asyncio.gather(*waits), 0.5)
        assert [i.public_key for i in peers.identities("router")] == [b"B" * 32]

    asyncio.run(scenario())


def test_a_known_key_stands_while_no_registry_answers():
    clock = FakeClock(100.0)
    peers = PeerKeys(ttl_s=30, clock=clock)
    key = CallKey().public_key
    answers = {"up": True}

    async def lookup(worker_id: str):
        if not answers["up"]:
            raise ConnectionError("UNAVAILABLE partitioned")
        return Identity(worker_id, "decode", key) if worker_id == "decode-0" and key else None

    async def scenario() -> None:
        nonlocal key
        peers.set_router("r:1", b"R" * 32, lookup)
        await peers.refresh("decode-0")
        answers["up"] = False
        clock.now += 31  # expired while the registry is cut off: kept
        await peers.refresh("decode-0")
        assert peers.identities("decode-0")[0].public_key == key
        await peers.refresh("decode-1")  # never known: still unknown
        assert peers.identities("decode-1") == ()
        answers["up"] = True
        key = b""  # deregistered meanwhile: the registry's answer ends the key
        clock.now += 2
        await peers.refresh("decode-0")
        assert peers.identities("decode-0") == ()

    asyncio.run(scenario())


def test_a_flood_of_admissions_or_one_callers_calls_leave_others_heartbeats_accepted(secret):
    clock = FakeClock(1_000_000.0)
    book = KeyBook(secret, role="decode")
    verifier = CallVerifier(secret, book, max_remembered=40, clock=clock)
    heartbeat = "/pdserve.v1.Registry/Heartbeat"
    flood = CallSigner(secret, "anyone", clock=clock)  # the cluster secret: v1, any caller id
    for i in range(40):
        verifier.verify(REGISTER, CallSigner(secret, f"stranger-{i}", clock=clock).credential(REGISTER))
    with pytest.raises(AuthError, match="too many"):
        verifier.verify(REGISTER, flood.credential(REGISTER))  # the admissions' window is full...
    worker = book.signer("decode-0", clock=clock)
    assert verifier.verify(heartbeat, worker.credential(heartbeat)) == "decode-0"  # ...signed calls are not
    noisy = book.signer("decode-noisy", clock=clock)
    for _ in range(10):  # a quarter of the window: its quota
        verifier.verify(heartbeat, noisy.credential(heartbeat))
    with pytest.raises(AuthError, match="this caller"):
        verifier.verify(heartbeat, noisy.credential(heartbeat))
    assert verifier.verify(heartbeat, worker.credential(heartbeat)) == "decode-0"  # another's quota is its own
    clock.now += 121  # the window passes: quotas come back
    verifier.verify(heartbeat, noisy.credential(heartbeat))


def test_an_unknown_caller_is_looked_up_only_after_proving_membership(secret):
    class CountingBook(KeyBook):
        lookups = 0

        async def refresh(self, caller_id: str) -> None:
            CountingBook.lookups += 1

    book = CountingBook(secret)
    verifier = CallVerifier(secret, book)
    stranger = CallSigner(secret, "decode-9", CallKey())  # a key nobody registered
    credential = stranger.credential(METHOD)
    with pytest.raises(AuthError, match="prove membership"):  # an outsider's made-up id: no lookup
        asyncio.run(verifier.check_learning(METHOD, credential, member_proof="00" * 32))
    assert CountingBook.lookups == 0
    outsider = CallSigner(ClusterSecret(b"o" * 32), "decode-9", CallKey())  # another secret's proof
    other = outsider.credential(METHOD)
    with pytest.raises(AuthError, match="prove membership"):
        asyncio.run(verifier.check_learning(METHOD, other, member_proof=outsider.member_proof(other)))
    assert CountingBook.lookups == 0
    with pytest.raises(UnknownCallerError):  # a member: its key is looked up (and here not found)
        asyncio.run(verifier.check_learning(METHOD, credential, member_proof=stranger.member_proof(credential)))
    assert CountingBook.lookups == 1
