"""Workers joining the router: the Registry protocol, routing policies, static workers, metrics,
restarts, and who may call it.
Real router listeners on 127.0.0.1, in-test workers (`router_fakes`)."""
from __future__ import annotations

import json

import grpc
import httpx
import pytest

from pdserve.common.block_hash import hash_prompt_blocks
from pdserve.proto.pdserve.v1 import registry_pb2, registry_pb2_grpc
from pdserve.router.config import Role, StaticWorker
from pdserve.security.credentials import (AUDIENCE_HEADER, CREDENTIAL_HEADER, DIGEST_HEADER, CallKey, CallSigner,
                                          CallVerifier, request_digest)
from pdserve.security.secret import ClusterSecret

from router_fakes import (
    BLOCK_SIZE,
    MODEL,
    REPLY,
    SALT,
    TOKENIZER,
    WAIT_S,
    FakeWorker,
    Script,
    chat_body,
    wait_until,
    words,
)


def test_registry_protocol(make_cluster):
    cluster = make_cluster()
    cluster.add("d0", compatibility_hash=77)
    with grpc.insecure_channel(cluster.registry_address) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Heartbeat(registry_pb2.HeartbeatRequest(worker_id="stranger"), timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as caught:
            stub.Register(registry_pb2.RegisterRequest(worker=registry_pb2.WorkerInfo(
                worker_id="x", role=registry_pb2.WORKER_ROLE_DECODE, grpc_address="nowhere")), timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        other = FakeWorker(registry_pb2.WORKER_ROLE_PREFILL, "p-bad", compatibility_hash=78, address="127.0.0.1:9")
        with pytest.raises(grpc.RpcError) as caught:
            stub.Register(registry_pb2.RegisterRequest(worker=other.info()), timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        gone = stub.Deregister(registry_pb2.DeregisterRequest(worker_id="d0", lease=cluster.workers["d0"].client._lease),
                               timeout=WAIT_S)
        assert gone.found
    # d0's next heartbeat is answered NOT_FOUND, so it registers again.
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        wait_until(lambda: http.get("/health").json()["decode_workers"] == 1, "d0 to re-register")


def test_only_the_process_that_registered_a_worker_id_can_act_for_it(make_cluster):
    """A registration's lease: without it, another process (which may hold every credential
    of the deployment) can neither deregister a live worker nor heartbeat for it nor take
    its id at another address; the worker itself heartbeats and serves on."""
    cluster = make_cluster()
    d0 = cluster.add("d0")
    impostor = FakeWorker(registry_pb2.WORKER_ROLE_DECODE, "d0", address="127.0.0.1:9")
    with grpc.insecure_channel(cluster.registry_address) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        for call, request in ((stub.Deregister, registry_pb2.DeregisterRequest(worker_id="d0")),
                              (stub.Deregister, registry_pb2.DeregisterRequest(worker_id="d0", lease=b"x" * 16)),
                              (stub.Heartbeat, registry_pb2.HeartbeatRequest(worker_id="d0"))):
            with pytest.raises(grpc.RpcError) as caught:
                call(request, timeout=WAIT_S)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as caught:
            stub.Register(registry_pb2.RegisterRequest(worker=impostor.info()), timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert cluster.router.registry.get("d0").worker.address == d0.address
    registrations = d0.client.num_registrations
    beats = cluster.router.registry.get("d0").last_seen
    wait_until(lambda: cluster.router.registry.get("d0").last_seen > beats, "d0's own heartbeats to go on")
    assert d0.client.num_registrations == registrations  # never pushed out
    cluster.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert len(d0.requests) == 1


def test_round_robin_spreads_and_session_affinity_sticks(make_cluster):
    cluster = make_cluster(decode_policy="round_robin")
    workers = [cluster.add("d0"), cluster.add("d1")]
    client = cluster.openai()
    for _ in range(4):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert [len(w.requests) for w in workers] == [2, 2]
    assert cluster.metric("pdserve_router_routing_decisions_total", pool="decode", policy="round_robin",
                          reason="round_robin") == 4

    sticky = make_cluster(decode_policy="session_affinity")
    sticky_workers = [sticky.add("s0"), sticky.add("s1")]
    for user in ("alice", "bob", "carol"):
        for _ in range(3):
            sticky.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=1, user=user)
        counts = [sum(1 for r in w.requests) for w in sticky_workers]
        assert sorted(counts)[-1] % 3 == 0  # all three requests of a user landed together
        for w in sticky_workers:
            w.requests.clear()


def test_a_worker_claiming_a_prefix_it_was_never_sent_wins_nothing(make_cluster):
    """Issue 48: through the real Registry, a decode whose KV events say it stored the blocks
    of a prompt the router never sent it is not preferred for that prompt: its claim is
    dropped (its index holds none of them), and the prompt lands by load, not 'prefix_match'
    (--check-prefix-claims)."""
    cluster = make_cluster(decode_policy="prefix_aware", prefill_policy="round_robin", check_prefix_claims=True)
    prompt = words(24)
    cached = hash_prompt_blocks(TOKENIZER.encode(prompt).ids, BLOCK_SIZE, SALT)
    rogue = cluster.add("rogue")
    index = cluster.router.registry.get("rogue").kv
    wait_until(lambda: index.next_seq > 0 and not index.syncing, "the rogue's index synced")
    seen = index.next_seq
    rogue.kv.on_event("device", "stored", cached)
    wait_until(lambda: index.next_seq > seen, "the rogue's event reached the router")
    assert index.num_blocks == 0 and cluster.router.registry.get("rogue").num_matched_blocks(cached) == 0
    cluster.add("d0")
    cluster.add("p0", role=registry_pb2.WORKER_ROLE_PREFILL)
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        answer = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt + " w100 w101", "max_tokens": 1})
    routing = answer.json()["pdserve"]["routing"]
    assert routing["decode_reason"] == "no_prefix_match" and routing["matched_prefix_tokens"] == 0, routing


def test_prefix_aware_routes_a_repeated_prefix_to_the_worker_holding_it(make_cluster):
    cluster = make_cluster(decode_policy="prefix_aware", prefill_policy="round_robin")
    prompt = words(24)
    cached = hash_prompt_blocks(TOKENIZER.encode(prompt).ids, BLOCK_SIZE, SALT)
    cluster.add("d0")
    holder = cluster.add("d1")
    holder.kv.on_event("device", "stored", cached)  # its pool caches the prompt's blocks: an event tells the router
    wait_until(lambda: cluster.router.registry.get("d1").num_matched_blocks(cached) == len(cached), "d1's events")
    prefill = cluster.add("p0", role=registry_pb2.WORKER_ROLE_PREFILL)
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        answer = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt + " w100 w101", "max_tokens": 1})
        routing = answer.json()["pdserve"]["routing"]
        assert (routing["decode_worker_id"], routing["decode_reason"]) == ("d1", "prefix_match")
        assert routing["matched_prefix_tokens"] == 24
        # Conditional disaggregation: 2 uncached tokens (<= 4) -> decode prefills locally.
        assert routing["prefill_reason"] == "short_uncached_prompt"
        assert answer.json()["pdserve"]["transfer"]["outcome"] == "local"
        assert len(holder.requests) == 1 and holder.requests[0].prefill.address == ""
        # A fresh long prompt goes anywhere, with a prefill worker; repeating its prefix follows it there.
        fresh = words(20, start=150)
        first = http.post("/v1/completions", json={"model": MODEL, "prompt": fresh, "max_tokens": 1}).json()
        assert first["pdserve"]["routing"]["decode_reason"] == "no_prefix_match"
        assert first["pdserve"]["routing"]["prefill_worker_id"] == "p0"
        assert first["pdserve"]["transfer"]["outcome"] == "transferred"
        chosen = cluster.workers[first["pdserve"]["routing"]["decode_worker_id"]]
        sent = chosen.requests[-1]
        assert sent.prefill.address == prefill.address and sent.prefill.worker_id == "p0"
        assert list(sent.block_hashes) == hash_prompt_blocks(sent.prompt_token_ids, BLOCK_SIZE, SALT)
        wait_until(lambda: cluster.router.registry.get(chosen.worker_id).num_matched_blocks(sent.block_hashes)
                   == len(sent.block_hashes), "the chosen worker's events")
        again = http.post("/v1/completions", json={"model": MODEL, "prompt": fresh + " w1", "max_tokens": 1}).json()
        assert again["pdserve"]["routing"]["decode_worker_id"] == chosen.worker_id
        assert again["pdserve"]["routing"]["decode_reason"] == "prefix_match"
    assert cluster.metric("pdserve_router_routing_decisions_total", pool="decode", policy="prefix_aware",
                          reason="prefix_match") == 2
    assert cluster.metric("pdserve_router_routing_decisions_total", pool="prefill", policy="round_robin",
                          reason="short_uncached_prompt") == 2


def test_metrics_endpoint_uses_its_own_registry(make_cluster):
    cluster = make_cluster()
    cluster.add("d0")
    cluster.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        text = http.get("/metrics").text
    assert 'pdserve_router_requests_total{api="http_chat",outcome="ok"} 1.0' in text
    assert "pdserve_router_inter_token_latency_seconds_count 3.0" in text
    assert 'pdserve_router_transfer_outcomes_total{backend="none",outcome="local"} 1.0' in text
    assert "python_gc_objects_collected_total" not in text  # not the global default registry


def test_static_workers_are_polled_without_registration(loop_thread, make_cluster):
    static = FakeWorker(registry_pb2.WORKER_ROLE_DECODE, "unused-id")
    loop_thread.run(static.start())
    try:
        cluster = make_cluster(static_workers=(StaticWorker(Role.DECODE, static.address),))
        client = cluster.openai()
        with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
            wait_until(lambda: http.get("/ready").status_code == 200, "the static worker to be polled")
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert chat.model_extra["pdserve"]["routing"]["decode_worker_id"] == f"decode@{static.address}"
    finally:
        loop_thread.run(static.kill())


def test_static_workers_are_refused_with_a_cluster_secret(tmp_path):
    """A worker verifies the router's calls with the key it learns by registering: a static
    worker never does, so a router with a cluster secret refuses them at start, saying why."""
    from pdserve.router.app import RouterApp
    from pdserve.router.config import ConfigError, RouterConfig

    ClusterSecret.create(tmp_path / "secret")
    config = RouterConfig(cluster_secret_file=str(tmp_path / "secret"),
                          static_workers=(StaticWorker(Role.DECODE, "127.0.0.1:1"),))
    with pytest.raises(ConfigError, match="must register"):
        RouterApp(config)


def test_pdserve_router_command_serves_and_stops_on_sigterm():
    """The real entry point: `pdserve router` in its own process, stopped by SIGTERM."""
    import select
    import signal
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "pdserve.deploy.cli", "router", "--http-port", "0",
                                "--grpc-port", "0", "--log-level", "WARNING"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([process.stdout], [], [], 3 * WAIT_S)
        assert ready, "no ready line within the deadline"
        line = process.stdout.readline()
        assert line.startswith("pdserve router ready http://127.0.0.1:"), (line, process.stderr.read())
        http_url = line.split()[3]
        assert httpx.get(f"{http_url}/health", timeout=WAIT_S).json()["status"] == "no_workers"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WAIT_S)


def test_workers_register_again_after_a_router_restart(loop_thread, make_cluster):
    cluster = make_cluster()
    worker = cluster.add("d0")
    ports = dict(grpc_port=cluster.router.grpc_port, registry_port=cluster.router.registry_port)
    loop_thread.run(cluster.router.stop(grace_s=0.1))
    restarted = make_cluster(**ports)  # same addresses, empty registry
    with httpx.Client(base_url=restarted.http, timeout=WAIT_S) as http:
        wait_until(lambda: http.get("/ready").status_code == 200, "d0 to register with the new router")
    # The router counts a worker before the worker reads the router's answer: wait for both.
    wait_until(lambda: worker.client.num_registrations == 2, "d0 to read the new router's answer")
    chat = restarted.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=1)
    assert chat.choices[0].message.content == "Hello"


def test_worker_errors_reach_the_client_and_refusals_move_on(make_cluster):
    # Liveness is not under test here: with the fixture's 1 s heartbeat timeout, a loaded CI
    # machine once stalled the shared loop past it, both workers were dropped, and the
    # retry found none (503). 5 s keeps every worker alive through such a stall.
    cluster = make_cluster(decode_policy="round_robin", worker_timeout_s=5.0)
    cluster.add("d0", script=Script(fail_after=0))  # refuses every request as invalid
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        refused = http.post("/v1/chat/completions", json=chat_body())
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop"
        cluster.workers["d0"].script = Script(fail_after=2, fail_code=grpc.StatusCode.INTERNAL)
        with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as streamed:
            events = [line.removeprefix("data: ") for line in streamed.iter_lines() if line]
        assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:2]] == ["Hello", ","]
        assert json.loads(events[2])["error"]["type"] == "server_error" and events[3] == "[DONE]"
        # A worker that is busy (RESOURCE_EXHAUSTED) before its first token: the next one serves.
        cluster.workers["d0"].script = Script(fail_after=0, fail_code=grpc.StatusCode.RESOURCE_EXHAUSTED)
        cluster.add("d1")
        answers = [http.post("/v1/chat/completions", json=chat_body(max_tokens=1)) for _ in range(2)]
        assert [a.status_code for a in answers] == [200, 200]
        assert {a.json()["pdserve"]["routing"]["decode_worker_id"] for a in answers} == {"d1"}


def test_a_prefill_worker_decode_could_not_reach_is_not_proposed_again(make_cluster):
    cluster = make_cluster(local_prefill_threshold=0, worker_timeout_s=5.0)
    cluster.add("d0", script=Script(prefill_status_code="UNAVAILABLE"))
    prefill = cluster.add("p0", role=registry_pb2.WORKER_ROLE_PREFILL)
    cluster.loop.run(prefill.kill())  # gone; its heartbeat would time out only after 5 s
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        first = http.post("/v1/completions", json={"model": MODEL, "prompt": words(10), "max_tokens": 1}).json()
        assert first["pdserve"]["routing"]["prefill_worker_id"] == "p0"
        assert first["pdserve"]["transfer"]["outcome"] == "recomputed"  # never a silent fallback
        second = http.post("/v1/completions", json={"model": MODEL, "prompt": words(10), "max_tokens": 1}).json()
        assert second["pdserve"]["routing"]["prefill_reason"] == "no_prefill_worker"
    assert cluster.metric("pdserve_router_transfer_outcomes_total", outcome="recomputed", backend="none") == 1


def test_registry_refuses_anonymous_and_impersonating_callers(make_cluster, tmp_path):
    secret_path = tmp_path / "cluster-secret"
    secret = ClusterSecret.create(secret_path)
    cluster = make_cluster(cluster_secret_file=str(secret_path))
    cluster.add("d0", signer=CallSigner(secret, "d0", CallKey()))
    impostor = FakeWorker(registry_pb2.WORKER_ROLE_DECODE, "d0", script=Script(pieces=("pwned",)))
    cluster.loop.run(impostor.start())
    cluster.workers["impostor"] = impostor

    def call(method: str, request, caller: str | None):
        metadata = [(CREDENTIAL_HEADER, CallSigner(secret, caller).credential(f"/pdserve.v1.Registry/{method}"))] \
            if caller else []
        with grpc.insecure_channel(cluster.registry_address) as channel:
            getattr(registry_pb2_grpc.RegistryStub(channel), method)(request, timeout=WAIT_S, metadata=metadata)

    takeover = registry_pb2.RegisterRequest(worker=impostor.info())
    for method, request, caller, code in (
            ("Register", takeover, None, grpc.StatusCode.UNAUTHENTICATED),  # anonymous
            ("Register", takeover, "evil", grpc.StatusCode.UNAUTHENTICATED),  # another id's credential
            ("Register", takeover, "d0", grpc.StatusCode.ALREADY_EXISTS),  # d0 is alive elsewhere
            ("Deregister", registry_pb2.DeregisterRequest(worker_id="d0"), None, grpc.StatusCode.UNAUTHENTICATED),
            ("Deregister", registry_pb2.DeregisterRequest(worker_id="d0"), "evil", grpc.StatusCode.UNAUTHENTICATED),
            ("Heartbeat", registry_pb2.HeartbeatRequest(worker_id="d0"), None, grpc.StatusCode.UNAUTHENTICATED),
            # what a compromised worker holding the cluster secret can mint: a valid credential
            # of d0. Without d0's lease it still cannot remove, replace or speak for d0
            ("Deregister", registry_pb2.DeregisterRequest(worker_id="d0"), "d0", grpc.StatusCode.UNAUTHENTICATED),
            ("Heartbeat", registry_pb2.HeartbeatRequest(worker_id="d0"), "d0", grpc.StatusCode.UNAUTHENTICATED)):
        with pytest.raises(grpc.RpcError) as caught:
            call(method, request, caller)
        assert caught.value.code() == code, (method, caller)
        assert "cluster-secret" not in (caught.value.details() or "")
    # garbage that is not even a protobuf is refused before it is parsed
    with grpc.insecure_channel(cluster.registry_address) as channel:
        raw = channel.unary_unary("/pdserve.v1.Registry/Register", request_serializer=None,
                                  response_deserializer=None)
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\xff\x00garbage", timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert cluster.metric("pdserve_router_auth_refused_total", reason="no credential") >= 4
    # a second header cannot lend a valid credential to a forged one: d0's, forged (another
    # deployment's secret), first; evil's valid one last
    forged = CallSigner(ClusterSecret.create(tmp_path / "other-secret"), "d0")
    for method, request in (("Deregister", registry_pb2.DeregisterRequest(worker_id="d0")),
                            ("Heartbeat", registry_pb2.HeartbeatRequest(worker_id="d0"))):
        full = f"/pdserve.v1.Registry/{method}"
        metadata = [(CREDENTIAL_HEADER, forged.credential(full)),
                    (CREDENTIAL_HEADER, CallSigner(secret, "evil").credential(full))]
        with grpc.insecure_channel(cluster.registry_address) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                getattr(registry_pb2_grpc.RegistryStub(channel), method)(request, timeout=WAIT_S, metadata=metadata)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        assert "exactly one" in caught.value.details()
    # the real worker still gets the traffic, and stays registered
    chat = cluster.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=8)
    assert chat.choices[0].message.content == "".join(REPLY) and not impostor.requests
    with httpx.Client(base_url=cluster.http, timeout=WAIT_S) as http:
        assert http.get("/health").status_code == 200


def test_router_calls_workers_with_its_credential(make_cluster, tmp_path):
    secret_path = tmp_path / "cluster-secret"
    secret = ClusterSecret.create(secret_path)
    cluster = make_cluster(cluster_secret_file=str(secret_path))
    worker = cluster.add("d0", signer=CallSigner(secret, "d0", CallKey()))
    cluster.openai().completions.create(model=MODEL, prompt="hello", max_tokens=4)
    sent = dict(worker.requests_metadata[-1])
    credential, digest, audience = sent[CREDENTIAL_HEADER], sent[DIGEST_HEADER], sent[AUDIENCE_HEADER]
    assert audience == worker.address and digest == request_digest(worker.requests[-1])  # bound to d0 and the request
    verifier = CallVerifier(secret, worker.peers)
    verifier.serve_as(worker.address)
    assert verifier.verify("/pdserve.v1.Decode/Decode", credential, digest, audience) == "router"
