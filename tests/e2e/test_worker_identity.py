"""One compromised worker is not every worker (issue 38, item 1), on real processes: a router,
one prefill and one decode with a cluster secret, the disk backend.

The attacker holds what a compromised prefill holds: the cluster secret file, and any key
pair it makes. With them it can mint an admission (v1) credential naming any id, and sign
(v2) as any id with its own key. It cannot call the decode as the router, abort or prefill
at the prefill as the decode, or heartbeat, deregister or re-register the decode at the
registry: each is refused. It can join as a new worker id (the accepted residual risk), and
as that worker it still may not drive a decode or a prefill. The service serves on, and
every KV block is back in its pool."""
from __future__ import annotations

import grpc
import httpx
import pytest
from harness import MODEL, deploy_workers, signed_metadata

from pdserve.proto.pdserve.v1 import (common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc,
                                      registry_pb2, registry_pb2_grpc)
from pdserve.security.credentials import CREDENTIAL_HEADER, MEMBER_HEADER, CallKey, CallSigner
from pdserve.security.secret import ClusterSecret

pytestmark = pytest.mark.slow

REFUSED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
CHAT = [{"role": "user", "content": "Tell me about lighthouses and the sea in three sentences."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("kvstore"))
    workers = [("prefill-0", "prefill", []), ("decode-0", "decode", [])]
    d = deploy_workers(workers, router_args=["--local-prefill-threshold", "0", "--static-routing"],
                       common=["--kv-backends", "disk", "--disk-store", store])
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def registry_address(cluster) -> str:
    argv = cluster.child("decode-0").argv
    return argv[argv.index("--router") + 1]


def transferred(cluster) -> float:
    """KV hand-offs that arrived (any backend), by the router's count."""
    text = httpx.get(cluster.base_url.replace("/v1", "/metrics"), timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_router_transfer_outcomes_total{") and 'outcome="transferred"' in line)


class Attacker:
    """Calls with credentials minted from the secret file alone: v1 naming anyone, or v2
    naming anyone but signed by its own key."""

    def __init__(self, secret: ClusterSecret) -> None:
        self.secret = secret
        self.key = CallKey()

    def metadata(self, method: str, caller: str, signed: bool, address: str = "", request=None
                 ) -> list[tuple[str, str]]:
        signer = CallSigner(self.secret, caller, self.key if signed else None)
        if signed and request is not None and address:  # bound to the server and the request, as services sign
            return signed_metadata(signer, method, address, request)
        credential = signer.credential(method)
        return [(CREDENTIAL_HEADER, credential), (MEMBER_HEADER, signer.member_proof(credential))]

    def call(self, address: str, stub_cls, method: str, request, caller: str, signed: bool):
        """The reply, or the grpc.RpcError it was refused with."""
        service = stub_cls.__name__.removesuffix("Stub")
        bound = service in ("Decode", "Prefill")
        metadata = self.metadata(f"/pdserve.v1.{service}/{method}", caller, signed, address if bound else "",
                                 request if bound else None)
        with grpc.insecure_channel(address) as channel:
            rpc = getattr(stub_cls(channel), method)
            try:
                reply = rpc(request, timeout=30, metadata=metadata)
                return list(reply) if method == "Decode" else reply
            except grpc.RpcError as err:
                return err


def chat_through(cluster) -> None:
    before = transferred(cluster)
    chat = cluster.openai().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    assert chat.choices[0].message.content
    assert transferred(cluster) == before + 1  # router -> decode -> prefill, each call verified by its key


def test_a_compromised_prefill_cannot_act_as_another_worker(cluster):
    chat_through(cluster)  # the real path: every signature verifies
    attacker = Attacker(ClusterSecret.load(cluster.secret_path))
    decode = cluster.worker_addresses("decode")["decode-0"]
    prefill = cluster.worker_addresses("prefill")["prefill-0"]
    registry = registry_address(cluster)
    decode_request = decode_pb2.DecodeRequest(request_id="forged", prompt_token_ids=[1, 2, 3],
                                              sampling=common_pb2.SamplingParams(max_tokens=2),
                                              prefill=decode_pb2.PrefillChoice(reason="test_local"))
    abort = common_pb2.AbortRequest(request_id="any")
    stolen_info = registry_pb2.WorkerInfo(worker_id="decode-0", role=registry_pb2.WORKER_ROLE_DECODE,
                                          grpc_address="127.0.0.1:1", model_name=MODEL, block_size=16)
    attempts = [
        (decode, decode_pb2_grpc.DecodeStub, "Decode", decode_request, "router"),
        (decode, decode_pb2_grpc.DecodeStub, "Abort", abort, "router"),
        (prefill, prefill_pb2_grpc.PrefillStub, "Abort", abort, "decode-0"),
        (prefill, prefill_pb2_grpc.PrefillStub, "Prefill", prefill_pb2.PrefillRequest(request_id="x"), "decode-0"),
        (registry, registry_pb2_grpc.RegistryStub, "Heartbeat", registry_pb2.HeartbeatRequest(worker_id="decode-0"),
         "decode-0"),
        (registry, registry_pb2_grpc.RegistryStub, "Deregister", registry_pb2.DeregisterRequest(worker_id="decode-0"),
         "decode-0"),
        (registry, registry_pb2_grpc.RegistryStub, "Lookup", registry_pb2.LookupRequest(worker_id="decode-0"),
         "decode-0"),
    ]
    for address, stub_cls, method, request, caller in attempts:
        for signed in (False, True):
            outcome = attacker.call(address, stub_cls, method, request, caller, signed)
            assert isinstance(outcome, grpc.RpcError) and outcome.code() in REFUSED, (method, caller, signed, outcome)
    # Register is an admission call (v1 suffices), but decode-0's live registration keeps its
    # id: another key is refused, whatever the credential names
    takeover = registry_pb2.RegisterRequest(worker=stolen_info, public_key=attacker.key.public_key)
    outcome = attacker.call(registry, registry_pb2_grpc.RegistryStub, "Register", takeover, "decode-0", False)
    assert isinstance(outcome, grpc.RpcError) and outcome.code() == grpc.StatusCode.ALREADY_EXISTS
    # nor may a new id take decode-0's address (which would replace its registration)
    takeover.worker.worker_id, takeover.worker.grpc_address = "decode-9", decode
    outcome = attacker.call(registry, registry_pb2_grpc.RegistryStub, "Register", takeover, "decode-9", False)
    assert isinstance(outcome, grpc.RpcError) and outcome.code() == grpc.StatusCode.ALREADY_EXISTS, outcome
    joined_as_new_worker_still_drives_nothing(cluster, attacker, decode, prefill, registry)
    chat_through(cluster)  # decode-0 and prefill-0 serve on, still registered
    cluster.assert_no_leaks()


def joined_as_new_worker_still_drives_nothing(cluster, attacker, decode, prefill, registry) -> None:
    """The residual risk: with the secret, an insider may join under a new id and its own key.
    As a prefill it may keep its own registration, but not drive a decode or a prefill."""
    info = registry_pb2.WorkerInfo(worker_id="prefill-evil", role=registry_pb2.WORKER_ROLE_PREFILL,
                                   grpc_address="127.0.0.1:1", model_name=MODEL, block_size=16)
    joined = attacker.call(registry, registry_pb2_grpc.RegistryStub, "Register",
                           registry_pb2.RegisterRequest(worker=info, public_key=attacker.key.public_key),
                           "prefill-evil", False)
    assert isinstance(joined, registry_pb2.RegisterResponse) and len(joined.router_public_key) == 32, joined
    try:
        for address, stub_cls, method, request in (
                (decode, decode_pb2_grpc.DecodeStub, "Abort", common_pb2.AbortRequest(request_id="any")),
                (prefill, prefill_pb2_grpc.PrefillStub, "Abort", common_pb2.AbortRequest(request_id="any"))):
            outcome = attacker.call(address, stub_cls, method, request, "prefill-evil", True)
            assert isinstance(outcome, grpc.RpcError) and outcome.code() in REFUSED, (method, outcome)
            assert "a prefill may not call" in outcome.details()
    finally:  # its own registration is its own to end (routing to it stops at once)
        left = attacker.call(registry, registry_pb2_grpc.RegistryStub, "Deregister",
                             registry_pb2.DeregisterRequest(worker_id="prefill-evil", lease=joined.lease),
                             "prefill-evil", True)
    assert isinstance(left, registry_pb2.DeregisterResponse) and left.found, left
