"""A request's transfer outcome is decided once (`verdict.decide`): senders and the
receiver's settlement only say whether the KV landed (`Landing`), the decode's failure
policy turns KV that is missing into RECOMPUTED or FAILED, and every outcome, ABORTED
included, crosses the wire as itself."""
from __future__ import annotations

import pytest

from pdserve.kvtransfer.verdict import (FAILURE_POLICIES, RECOMPUTE, Fallback, Landing, Outcome, RequestVerdict,
                                        TransferVerdict, decide)
from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.worker.transfer import request_verdict_to_proto, verdict_from_proto, verdict_to_proto

NOT_LANDED = TransferVerdict("ab", Landing.MISSING, "", fallbacks=(Fallback("ucx", "connection refused"),))


def test_kv_that_did_not_land_is_recomputed_or_failed_by_the_policy_with_its_reason():
    recomputed = decide(NOT_LANDED, RECOMPUTE)
    assert (recomputed.outcome, recomputed.backend) == (Outcome.RECOMPUTED, RECOMPUTE)
    assert recomputed.reason == "transfer_failed: connection refused"
    assert recomputed.transfer == NOT_LANDED  # what the transfer said stays as it was
    failed = decide(NOT_LANDED, "fail")
    assert (failed.outcome, failed.backend, failed.reason) == (Outcome.FAILED, "", recomputed.reason)
    given = TransferVerdict("ab", Landing.MISSING, "", reason="prefill_unavailable: UNAVAILABLE")
    assert decide(given, RECOMPUTE).reason == "prefill_unavailable: UNAVAILABLE"  # a reason given stands


@pytest.mark.parametrize("landing, outcome", [(Landing.LANDED, Outcome.TRANSFERRED), (Landing.ABORTED, Outcome.ABORTED)])
@pytest.mark.parametrize("policy", FAILURE_POLICIES)
def test_what_landed_or_was_aborted_stands_under_either_policy(landing, outcome, policy):
    settled = TransferVerdict("ab", landing, "ucx" if landing == Landing.LANDED else "")
    decided = decide(settled, policy)
    assert (decided.outcome, decided.transfer, decided.backend) == (outcome, settled, settled.backend)


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="failure policy"):
        decide(NOT_LANDED, "retry")


@pytest.mark.parametrize("landing, wire_name", [(Landing.LANDED, "TRANSFERRED"), (Landing.MISSING, "FAILED"),
                                                (Landing.ABORTED, "ABORTED")])
def test_a_transfer_verdict_crosses_the_wire_and_comes_back_as_itself(landing, wire_name):
    sent = TransferVerdict("ab", landing, "", reason="why")
    wire = verdict_to_proto(sent)
    assert common_pb2.TransferOutcome.Name(wire.outcome) == f"TRANSFER_OUTCOME_{wire_name}"
    assert verdict_from_proto(wire).landing == landing


@pytest.mark.parametrize("wire", [common_pb2.TRANSFER_OUTCOME_RECOMPUTED, common_pb2.TRANSFER_OUTCOME_LOCAL,
                                  common_pb2.TRANSFER_OUTCOME_UNSPECIFIED])
def test_a_peers_verdict_that_is_not_a_landing_reads_as_kv_missing(wire):
    """A prefill answers only landed, missing or aborted; anything else it says is not KV here."""
    assert verdict_from_proto(common_pb2.TransferVerdict(outcome=wire)).landing == Landing.MISSING


@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_request_outcome_crosses_the_wire_as_itself(outcome):
    wire = request_verdict_to_proto(RequestVerdict(outcome, NOT_LANDED, reason="why"))
    assert common_pb2.TransferOutcome.Name(wire.outcome) == f"TRANSFER_OUTCOME_{outcome.name}"
    assert wire.reason == "why" and [f.backend for f in wire.fallbacks] == ["ucx"]
    assert wire.backend == ""  # the KV was carried by no backend; "recompute" is not one
