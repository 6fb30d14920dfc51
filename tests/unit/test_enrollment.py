"""Enrollment tokens (security.enrollment): a token registers only the worker id, role and
host it names, only while it is not used up and its worker not revoked, and only when
signed by the deployment's enrollment key (which the router does not hold)."""
from __future__ import annotations

import pytest

from pdserve.security.enrollment import ANY_HOST, EnrollmentError, EnrollmentIssuer, EnrollmentVerifier


def test_a_token_registers_only_what_it_names() -> None:
    issuer = EnrollmentIssuer()
    verifier = EnrollmentVerifier(issuer.public_key)
    token = issuer.issue("decode-0", "decode", "127.0.0.1")
    verifier.check(token, "decode-0", "decode", "127.0.0.1:5000")
    for worker_id, role, address in (("decode-rogue", "decode", "127.0.0.1:5000"),
                                     ("decode-0", "prefill", "127.0.0.1:5000"),
                                     ("decode-0", "decode", "10.0.0.9:5000")):
        with pytest.raises(EnrollmentError):
            verifier.check(token, worker_id, role, address)
    anywhere = issuer.issue("decode-1", "decode", ANY_HOST)
    verifier.check(anywhere, "decode-1", "decode", "[::1]:7000")


def test_no_token_a_forged_one_or_another_deployments_is_refused() -> None:
    issuer, other = EnrollmentIssuer(), EnrollmentIssuer()
    verifier = EnrollmentVerifier(issuer.public_key)
    forged = issuer.issue("decode-0", "decode").split(" ")
    forged[1] = "decode-rogue"  # the signed fields changed
    for token in (None, "", "e1 x", " ".join(forged), other.issue("decode-rogue", "decode"), "e1 " + "a " * 600):
        with pytest.raises(EnrollmentError):
            verifier.check(token, "decode-rogue", "decode", "127.0.0.1:1")


def test_registrations_per_token_are_capped_and_a_worker_can_be_revoked() -> None:
    issuer = EnrollmentIssuer()
    verifier = EnrollmentVerifier(issuer.public_key, max_registrations=2)
    token = issuer.issue("prefill-0", "prefill")
    verifier.check(token, "prefill-0", "prefill", "127.0.0.1:1")
    verifier.check(token, "prefill-0", "prefill", "127.0.0.1:1")  # a restart registers again
    with pytest.raises(EnrollmentError, match="used up"):
        verifier.check(token, "prefill-0", "prefill", "127.0.0.1:1")
    fresh = issuer.issue("prefill-1", "prefill")
    verifier.revoke("prefill-1")
    with pytest.raises(EnrollmentError, match="revoked"):
        verifier.check(fresh, "prefill-1", "prefill", "127.0.0.1:1")
