"""A decode's signature on a hand-off covers every field of the hand-off and of the request
it rides in, each encoded without ambiguity: changing any one of them, or regrouping a list
(two endpoints rewritten as one), breaks it."""
from __future__ import annotations

import pytest

from pdserve.common.errors import AuthError
from pdserve.proto.pdserve.v1 import common_pb2, prefill_pb2
from pdserve.security.secret import ClusterSecret, Mac
from pdserve.worker.transfer import check_handoff_signature, sign_handoff

MAC = Mac(ClusterSecret(b"s" * 32).key("handoff"))


def signed() -> prefill_pb2.PrefillRequest:
    handoff = prefill_pb2.KVHandoff(
        transfer_id="ab" * 16, backends=["ucx", "disk"], block_ids=[3, 4], num_cached_tokens=16,
        deadline_unix_ms=1_900_000_000_000, compatibility_hash=7, decode_worker_id="decode-0",
        endpoints=[prefill_pb2.TransferEndpoint(backend="ucx", address="10.0.0.2:5000"),
                   prefill_pb2.TransferEndpoint(backend="disk", address="/kv")])
    request = prefill_pb2.PrefillRequest(
        request_id="r1", prompt_token_ids=list(range(40)), block_hashes=[11, 12], handoff=handoff,
        sampling=common_pb2.SamplingParams(temperature=0.5, seed=3), cache_salt="tenant")
    sign_handoff(request, MAC)
    return request


def refused(request: prefill_pb2.PrefillRequest) -> bool:
    try:
        check_handoff_signature(request, MAC)
    except AuthError:
        return True
    return False


# one change per field; a test below checks that every field of both messages has one
CHANGES = {
    "handoff.transfer_id": lambda r: setattr(r.handoff, "transfer_id", "cd" * 16),
    "handoff.backends": lambda r: r.handoff.backends.append("nccl"),
    "handoff.endpoints": lambda r: setattr(r.handoff.endpoints[0], "address", "10.0.0.9:5000"),
    "handoff.block_ids": lambda r: r.handoff.block_ids.append(9),
    "handoff.num_cached_tokens": lambda r: setattr(r.handoff, "num_cached_tokens", 0),
    "handoff.deadline_unix_ms": lambda r: setattr(r.handoff, "deadline_unix_ms", r.handoff.deadline_unix_ms + 1),
    "handoff.compatibility_hash": lambda r: setattr(r.handoff, "compatibility_hash", 8),
    "handoff.decode_worker_id": lambda r: setattr(r.handoff, "decode_worker_id", "decode-1"),
    "request_id": lambda r: setattr(r, "request_id", "r2"),
    "prompt_token_ids": lambda r: r.prompt_token_ids.append(1),
    "block_hashes": lambda r: r.block_hashes.append(13),
    "sampling": lambda r: setattr(r.sampling, "temperature", 0.0),
    "cache_salt": lambda r: setattr(r, "cache_salt", "other"),
    "handoff.lora_name": lambda r: setattr(r.handoff, "lora_name", "adapter"),
    "handoff.lora_digest": lambda r: setattr(r.handoff, "lora_digest", "00ff"),
}


def test_the_signature_holds_on_the_request_it_was_made_for():
    assert not refused(signed())


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_changing_any_field_breaks_the_signature(field):
    request = signed()
    CHANGES[field](request)
    assert refused(request)


def test_every_field_of_the_request_and_the_handoff_is_covered():
    request_fields = {f.name for f in prefill_pb2.PrefillRequest.DESCRIPTOR.fields} - {"handoff"}
    handoff_fields = {f"handoff.{f.name}" for f in prefill_pb2.KVHandoff.DESCRIPTOR.fields} - {"handoff.signature"}
    assert set(CHANGES) == request_fields | handoff_fields


def test_two_endpoints_rewritten_as_one_do_not_verify():
    request = signed()
    del request.handoff.endpoints[:]
    request.handoff.endpoints.append(prefill_pb2.TransferEndpoint(backend="ucx", address="10.0.0.2:5000|disk=/kv"))
    assert refused(request)
    request = signed()
    del request.handoff.backends[:]
    request.handoff.backends.append("ucx,disk")  # one name holding both
    assert refused(request)
