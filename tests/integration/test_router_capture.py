"""Routing can't be captured by one worker (issue 48, item 5), through the real router and
registry with fake workers: a decode's verdict naming a worker other than the prefill the
router planned takes no one out of routing; a decode that refuses a request after reading it
becomes the last choice; a registrant whose chat template disagrees with the one the model
was pinned with is refused."""
from __future__ import annotations

import grpc
from router_fakes import WAIT_S, FakeWorker, Script, chat_body, wait_until, words

from pdserve.proto.pdserve.v1 import registry_pb2
from pdserve.router.config import Role
from pdserve.worker.registry_client import RegistryClient

LONG = chat_body(messages=[{"role": "user", "content": words(20)}], max_tokens=2)  # remote prefill


def test_a_verdict_may_name_only_the_planned_prefill(make_cluster, caplog):
    cluster = make_cluster(static_routing=True, decode_policy="round_robin")
    cluster.add("p0", registry_pb2.WORKER_ROLE_PREFILL)
    victim = cluster.add("d-victim")
    cluster.add("d-rogue", script=Script(prefill_status_code="UNAVAILABLE", verdict_names="d-victim"))
    client = cluster.openai()
    for _ in range(2):  # round robin: one of them reaches the rogue
        client.chat.completions.create(**LONG)
    registry = cluster.router.registry
    assert len(cluster.workers["d-rogue"].requests) == 1 and len(victim.requests) == 1
    assert not registry.get("d-victim").suspect and not registry.get("p0").suspect
    assert not any("marked suspect" in r.getMessage() for r in caplog.records)
    assert any("not its planned prefill 'p0': ignored" in r.getMessage() for r in caplog.records)


def test_a_refusal_after_reading_the_request_counts_against_the_refuser(make_cluster):
    cluster = make_cluster(decode_policy="round_robin")
    refuser = cluster.add("d-refuser", script=Script(fail_after=0, fail_code=grpc.StatusCode.RESOURCE_EXHAUSTED))
    good = cluster.add("d-good")
    client = cluster.openai()
    while not refuser.requests:  # round robin reaches it; the request is served by the other
        assert client.chat.completions.create(**chat_body(max_tokens=2)).choices[0].message.content
    routable = [r.worker_id for r in cluster.router.registry.routable(Role.DECODE, "tiny-chat")]
    assert routable == ["d-good"]  # the refuser is the last choice now
    before = len(refuser.requests)
    client.chat.completions.create(**chat_body(max_tokens=2))
    assert len(refuser.requests) == before and good.requests


def test_a_registrant_with_another_chat_template_is_refused(make_cluster):
    cluster = make_cluster()
    first = cluster.add("d-first")
    cluster.loop.run(first.kill())  # no other decode of the model is alive now
    wait_until(lambda: not cluster.router.registry.alive(Role.DECODE), "d-first aged out")
    impostor = FakeWorker(registry_pb2.WORKER_ROLE_DECODE, "d-impostor", chat_template="{{ 'pwned' }}")

    async def try_register() -> RegistryClient:
        await impostor.start()
        client = RegistryClient(cluster.registry_address, impostor.info(), impostor.load, rpc_timeout_s=WAIT_S,
                                retry_s=0.05)
        client.start()
        return client

    client = cluster.loop.run(try_register())
    try:
        wait_until(lambda: client.num_refused >= 1, "the impostor's Register refused")
        assert not client.registered and cluster.router.registry.get("d-impostor") is None
        assert cluster.router.catalog.resolve("tiny-chat").info.chat_template != "{{ 'pwned' }}"
    finally:
        impostor.client = client
        cluster.loop.run(impostor.kill())
