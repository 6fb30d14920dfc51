"""The router's client gRPC port against a client who is not what it claims (DESIGN §7):
nothing of a call is read before its API key, calls in flight are bounded, a client's
request_id is a capped printable label, and Abort stops only the caller's own request. Each
refusal goes through a real router on 127.0.0.1 (in-test workers, `router_fakes`), and the
router serves on afterwards."""
from __future__ import annotations

import re
import subprocess
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.proto.pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from router_fakes import MODEL, WAIT_S, Script, wait_until
from support import grpc_flood_argv

KEY = "sekret"
AUTH = (("authorization", f"Bearer {KEY}"),)
NUM_FLOOD_CALLS = 200
FLOOD_BYTES = 3_900_000  # under the 4 MiB receive limit: grpc itself would take each one in


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def own_channel(address: str) -> grpc.Channel:
    """A channel on a connection of its own: another caller, as far as the router can tell."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def hello(stub: generation_pb2_grpc.GenerationStub, **fields) -> list[generation_pb2.GenerateResponse]:
    return list(stub.Generate(generation_pb2.GenerateRequest(model=MODEL, prompt="hello", **fields),
                              timeout=WAIT_S, metadata=AUTH))


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def test_anonymous_large_calls_are_refused_unread_and_the_router_stays_small(make_cluster):
    """200 concurrent ~3.9 MB Generate calls without the key (from another process, so this
    process's memory is the router's): all UNAUTHENTICATED, unread, so the router's RSS stays
    within 100 MiB of where it was; a call with the key is served afterwards."""
    cluster = make_cluster(api_key=KEY, max_body_bytes=4 * 1024 * 1024)
    cluster.add("d0")
    before = peak = rss_mib()
    flood = subprocess.Popen(grpc_flood_argv(cluster.grpc_address, "/pdserve.v1.Generation/Generate",
                                             NUM_FLOOD_CALLS, FLOOD_BYTES), stdout=subprocess.PIPE, text=True)
    done = threading.Event()
    reader = threading.Thread(target=lambda: (flood.wait(120), done.set()), daemon=True)
    reader.start()
    while not done.wait(0.02):
        peak = max(peak, rss_mib())
    codes = flood.stdout.read().split()
    after = rss_mib()
    print(f"router RSS under {NUM_FLOOD_CALLS} x {FLOOD_BYTES / 1e6:.1f} MB anonymous calls: before {before:.0f} MiB, "
          f"peak {peak:.0f} MiB (+{peak - before:.0f}), after {after:.0f} MiB (+{after - before:.0f})")
    assert codes == ["UNAUTHENTICATED"] * NUM_FLOOD_CALLS, codes
    assert peak - before < 100, f"router RSS grew {peak - before:.0f} MiB"  # read, up to 780 MB at once
    assert cluster.metric("pdserve_router_requests_total", api="grpc", outcome="unauthenticated") == NUM_FLOOD_CALLS
    channel, stub = cluster.generation()
    with channel:
        assert "".join(r.text for r in hello(stub)) == "Hello, world!"


def test_every_client_call_needs_the_key_and_probes_do_not(make_cluster):
    """Generate, Abort and ModelInfo without the key, with a wrong one or with two
    `authorization` entries: UNAUTHENTICATED. Health checking answers without it."""
    cluster = make_cluster(api_key=KEY)
    decode = cluster.add("d0")
    channel, stub = cluster.generation()
    with channel:
        for metadata in ((), (("authorization", "Bearer nope"),), AUTH + (("authorization", "Bearer nope"),)):
            calls = (lambda: list(stub.Generate(generation_pb2.GenerateRequest(model=MODEL, prompt="hello"),
                                                timeout=WAIT_S, metadata=metadata)),
                     lambda: stub.Abort(common_pb2.AbortRequest(request_id="x"), timeout=WAIT_S, metadata=metadata),
                     lambda: stub.ModelInfo(common_pb2.ModelInfoRequest(), timeout=WAIT_S, metadata=metadata))
            for call in calls:
                assert refusal(call).code() == grpc.StatusCode.UNAUTHENTICATED
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=WAIT_S)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        assert stub.ModelInfo(common_pb2.ModelInfoRequest(), timeout=WAIT_S, metadata=AUTH).model_name == MODEL
        assert "".join(r.text for r in hello(stub)) == "Hello, world!"
    assert len(decode.requests) == 1


def test_calls_in_flight_are_bounded(make_cluster):
    """At most max_queue + CONTROL_CALLS calls at once on the client port; one more is
    RESOURCE_EXHAUSTED, and calls go through again once the others end."""
    from pdserve.router.app import CONTROL_CALLS

    cluster = make_cluster(api_key=KEY, max_queue=1)
    cluster.add("d0")
    channel, stub = cluster.generation()
    with channel:
        health = health_pb2_grpc.HealthStub(channel)
        watches = [health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
                   for _ in range(1 + CONTROL_CALLS)]
        try:
            for watch in watches:  # each one open on the router
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            busy = refusal(lambda: stub.ModelInfo(common_pb2.ModelInfoRequest(), timeout=WAIT_S, metadata=AUTH))
            assert busy.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            for watch in watches:
                watch.cancel()

        def served() -> bool:
            try:
                return stub.ModelInfo(common_pb2.ModelInfoRequest(), timeout=WAIT_S, metadata=AUTH).model_name == MODEL
            except grpc.RpcError:
                return False
        wait_until(served, "a call once the watches ended")
        assert "".join(r.text for r in hello(stub)) == "Hello, world!"


@pytest.mark.parametrize("label", ["x" * 65, "a\nb", "tab\there", "bell\x07", "line\u2028sep"],
                         ids=["65-chars", "newline", "tab", "control", "line-separator"])
def test_a_request_id_that_is_no_printable_label_is_invalid_argument(make_cluster, label):
    cluster = make_cluster(api_key=KEY)
    decode = cluster.add("d0")
    channel, stub = cluster.generation()
    with channel:
        err = refusal(lambda: hello(stub, request_id=label))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(err.trailing_metadata() or ()).get("pdserve-error-param") == "request_id"
        assert label not in err.details()
        reason = refusal(lambda: stub.Abort(common_pb2.AbortRequest(request_id="x", reason=label), timeout=WAIT_S,
                                            metadata=AUTH))
        assert reason.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "".join(r.text for r in hello(stub)) == "Hello, world!"
    assert len(decode.requests) == 1


def test_the_router_assigns_the_ids_workers_act_on(make_cluster):
    """A client's request_id (up to 64 printable characters) is echoed, never sent to a
    worker; without one, the router's id is echoed. Router ids are 128 random bits."""
    cluster = make_cluster(api_key=KEY)
    decode = cluster.add("d0")
    channel, stub = cluster.generation()
    label = "é-" + "x" * 62
    with channel:
        assert {r.request_id for r in hello(stub, request_id=label)} == {label}
        unnamed = hello(stub)
    sent = [r.request_id for r in decode.requests]
    assert label not in sent and len(set(sent)) == 2
    assert all(re.fullmatch(r"req-[0-9a-f]{32}", s) for s in sent), sent
    assert {r.request_id for r in unnamed} == {sent[1]}


def test_abort_stops_only_the_callers_own_request(make_cluster):
    """Two callers (two connections) use the same label: neither is told the other's is in
    flight, neither's Abort (by label or by the router's id) touches the other's request,
    each one's Abort stops its own. The same caller reusing a label in flight is
    ALREADY_EXISTS."""
    cluster = make_cluster(api_key=KEY)
    decode = cluster.add("d0", script=Script(hold_after=1))
    with own_channel(cluster.grpc_address) as a_channel, own_channel(cluster.grpc_address) as b_channel:
        a = generation_pb2_grpc.GenerationStub(a_channel)
        b = generation_pb2_grpc.GenerationStub(b_channel)
        request = generation_pb2.GenerateRequest(model=MODEL, prompt="hello", request_id="shared")
        a_call = a.Generate(request, timeout=WAIT_S, metadata=AUTH)
        assert next(a_call).text == "Hello"
        a_id = decode.requests[-1].request_id
        for key in ("shared", a_id):
            assert not b.Abort(common_pb2.AbortRequest(request_id=key), timeout=WAIT_S, metadata=AUTH).found
        assert decode.aborts == []

        b_call = b.Generate(request, timeout=WAIT_S, metadata=AUTH)  # the same label, another caller
        assert next(b_call).text == "Hello"
        b_id = decode.requests[-1].request_id
        assert b_id != a_id
        again = refusal(lambda: list(a.Generate(request, timeout=WAIT_S, metadata=AUTH)))
        assert again.code() == grpc.StatusCode.ALREADY_EXISTS

        assert b.Abort(common_pb2.AbortRequest(request_id="shared"), timeout=WAIT_S, metadata=AUTH).found
        assert list(b_call)[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert decode.aborts == [b_id]
        assert a.Abort(common_pb2.AbortRequest(request_id=a_id), timeout=WAIT_S, metadata=AUTH).found
        assert list(a_call)[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert decode.aborts == [b_id, a_id]

        decode.script = Script()
        assert "".join(r.text for r in hello(a, request_id="shared")) == "Hello, world!"
