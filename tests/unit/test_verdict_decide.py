"""A request's transfer outcome is decided once (`verdict.decide`): senders and the
receiver's settlement only say whether the KV landed, the decode's failure policy turns KV
that did not land into RECOMPUTED or FAILED, and every outcome, ABORTED included, crosses
the wire as itself."""
from __future__ import annotations

import pytest

from pdserve.kvtransfer.verdict import FAILURE_POLICIES, RECOMPUTE, Fallback, Outcome, TransferVerdict, decide
from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.worker.transfer import verdict_from_proto, verdict_to_proto

NOT_LANDED = TransferVerdict("ab", Outcome.FAILED, "", fallbacks=(Fallback("ucx", "connection refused"),))


def test_kv_that_did_not_land_is_recomputed_or_failed_by_the_policy_with_its_reason():
    recomputed = decide(NOT_LANDED, RECOMPUTE)
    assert (recomputed.outcome, recomputed.backend) == (Outcome.RECOMPUTED, RECOMPUTE)
    assert recomputed.reason == "transfer_failed: connection refused"
    failed = decide(NOT_LANDED, "fail")
    assert (failed.outcome, failed.backend, failed.reason) == (Outcome.FAILED, "", recomputed.reason)
    given = TransferVerdict("ab", Outcome.FAILED, "", reason="prefill_unavailable: UNAVAILABLE")
    assert decide(given, RECOMPUTE).reason == "prefill_unavailable: UNAVAILABLE"  # a reason given stands


@pytest.mark.parametrize("outcome", [Outcome.TRANSFERRED, Outcome.ABORTED, Outcome.LOCAL])
@pytest.mark.parametrize("policy", FAILURE_POLICIES)
def test_what_landed_was_aborted_or_never_asked_for_stands_under_either_policy(outcome, policy):
    settled = TransferVerdict("ab", outcome, "ucx" if outcome == Outcome.TRANSFERRED else "")
    assert decide(settled, policy) == settled


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="failure policy"):
        decide(NOT_LANDED, "retry")


@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_outcome_crosses_the_wire_as_itself(outcome):
    sent = TransferVerdict("ab", outcome, "", reason="why")
    wire = verdict_to_proto(sent)
    assert common_pb2.TransferOutcome.Name(wire.outcome) == f"TRANSFER_OUTCOME_{outcome.name}"
    assert verdict_from_proto(wire).outcome == outcome
