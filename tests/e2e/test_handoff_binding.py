"""Hand-offs bound to their request and tenants kept apart (issue 25, items 3 and 6), on real
processes with a cluster secret: router, one prefill, one decode, the disk backend.

The attacker holds a worker's identity (the test registers decode ids of its own, each with
its own key, as a compromised worker could for itself) or has captured a signed hand-off. A
replayed hand-off, a hand-off presented by a caller other than the decode it names, one
carried with another prompt, and one whose block hashes are not the prompt's are each refused
with a clear error; the services stay healthy and every KV block is back in its pool. Through the router,
prompts with different `cache_salt`s share no cached block and the same salt does."""
from __future__ import annotations

import time
import uuid

import grpc
import httpx
import pytest
from harness import MODEL, deploy_workers, registered_decode, signed_metadata

from pdserve.proto.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from pdserve.security.secret import ClusterSecret, Mac
from pdserve.worker.transfer import sign_handoff

pytestmark = pytest.mark.slow

PROMPT = " ".join(f"Line {i}: tenants share a server but never a cache." for i in range(12))  # ~150 tokens
PREFILL_METHOD = "/pdserve.v1.Prefill/Prefill"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("kvstore"))
    common = ["--kv-backends", "disk", "--disk-store", store]
    workers = [("prefill-0", "prefill", []), ("decode-0", "decode", [])]
    d = deploy_workers(workers, router_args=["--local-prefill-threshold", "0", "--static-routing"], common=common)
    d.store = store
    yield d
    from pdserve.deploy import up

    up.stop(d.children)


def cached_tokens(cluster, cache_salt: str | None) -> int:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    reply = httpx.post(f"{cluster.base_url}/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_separates_tenants_through_the_router(cluster):
    assert cached_tokens(cluster, "tenant-a") == 0
    assert cached_tokens(cluster, "tenant-a") > 0  # the same salt shares
    assert cached_tokens(cluster, "tenant-b") == 0  # another salt shares nothing
    assert cached_tokens(cluster, None) == 0  # nor does no salt
    too_long = httpx.post(f"{cluster.base_url}/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "cache_salt": "x" * 257})
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error"
    cluster.assert_no_leaks()


def signed_request(cluster, prompt_ids: list[int], compat: int, *, decode: str = "decode-probe",
                   block_hashes=()) -> prefill_pb2.PrefillRequest:
    handoff = prefill_pb2.KVHandoff(
        transfer_id=uuid.uuid4().hex, backends=["disk"], decode_worker_id=decode,
        endpoints=[prefill_pb2.TransferEndpoint(backend="disk", address=cluster.store)],
        block_ids=list(range(1, 1 + -(-len(prompt_ids) // 16))), compatibility_hash=compat,
        deadline_unix_ms=int(time.time() * 1000) + 60_000)
    request = prefill_pb2.PrefillRequest(request_id=f"r-{uuid.uuid4().hex[:8]}", prompt_token_ids=prompt_ids,
                                         block_hashes=list(block_hashes), handoff=handoff,
                                         sampling=common_pb2.SamplingParams(max_tokens=1))
    sign_handoff(request, Mac(ClusterSecret.load(cluster.secret_path).key("handoff")))
    return request


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def test_handoffs_are_used_once_by_the_decode_they_name_for_their_own_prompt(cluster):
    prefill = cluster.worker_addresses("prefill")["prefill-0"]
    with grpc.insecure_channel(prefill) as channel, registered_decode(cluster, "decode-probe", 1) as probe, \
            registered_decode(cluster, "decode-thief", 2) as thief:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        signers = {"decode-probe": probe, "decode-thief": thief}

        def call(request, caller="decode-probe"):
            metadata = signed_metadata(signers[caller], PREFILL_METHOD, prefill, request)
            return stub.Prefill(request, timeout=60, metadata=metadata)

        info = stub.ModelInfo(common_pb2.ModelInfoRequest(), timeout=30,
                              metadata=cluster.credentials("/pdserve.v1.Prefill/ModelInfo", "decode-probe"))
        prompt = list(range(100, 140))
        captured = signed_request(cluster, prompt, info.block_hash_salt)
        first = call(captured)  # the decode's own, legitimate use
        assert first.verdict.outcome == common_pb2.TRANSFER_OUTCOME_TRANSFERRED
        replayed = refusal(lambda: call(captured))
        assert replayed.code() == grpc.StatusCode.UNAUTHENTICATED and "already used" in replayed.details()

        other = signed_request(cluster, prompt, info.block_hash_salt)
        stolen = refusal(lambda: call(other, caller="decode-thief"))  # another worker presenting the probe's
        assert stolen.code() == grpc.StatusCode.UNAUTHENTICATED and "names decode 'decode-probe'" in stolen.details()

        relayed = signed_request(cluster, prompt, info.block_hash_salt)
        relayed.prompt_token_ids[:] = list(range(500, 540))  # same length, another prompt
        swapped = refusal(lambda: call(relayed))
        assert swapped.code() == grpc.StatusCode.UNAUTHENTICATED and "for this request" in swapped.details()

        lying = signed_request(cluster, prompt, info.block_hash_salt, block_hashes=[1, 2])  # signed, but not the prompt's
        mismatched = refusal(lambda: call(lying))
        assert mismatched.code() == grpc.StatusCode.INVALID_ARGUMENT and "block_hashes" in mismatched.details()

        assert call(other).verdict.outcome == common_pb2.TRANSFER_OUTCOME_TRANSFERRED  # refused uses cost nothing
    chat = cluster.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, temperature=0)
    assert chat.choices[0].message.content  # still serving
    cluster.assert_no_leaks()
