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


def test_the_public_key_is_read_as_hex_pem_or_a_certificate_as_helm_makes_it(tmp_path) -> None:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_private_key
    from cryptography.x509.oid import NameOID

    from pdserve.security.enrollment import load_public_key

    issuer = EnrollmentIssuer()
    (tmp_path / "private.pem").write_bytes(issuer.private_pem())
    (tmp_path / "private.pem").chmod(0o600)
    loaded = EnrollmentIssuer.load(str(tmp_path / "private.pem"))
    assert loaded.public_key == issuer.public_key
    private = load_pem_private_key(issuer.private_pem(), None)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve-enrollment")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(private, None))
    pem = private.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo).decode()
    for text in (issuer.public_key.hex(), pem, cert.public_bytes(Encoding.PEM).decode()):
        assert load_public_key(text) == issuer.public_key
        verifier = EnrollmentVerifier.from_hex(text)
        verifier.check(loaded.issue("decode-0", "decode"), "decode-0", "decode", "10.0.0.1:1")
    ec_pem = generate_private_key(SECP256R1()).public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    for bad in ("zz", "00" * 31, ec_pem.decode(), "-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----"):
        with pytest.raises(ValueError):
            load_public_key(bad)
    (tmp_path / "shared.pem").write_bytes(issuer.private_pem())
    (tmp_path / "shared.pem").chmod(0o644)
    with pytest.raises(ValueError, match="readable by others"):
        EnrollmentIssuer.load(str(tmp_path / "shared.pem"))


def test_the_router_reads_the_public_key_from_a_file_and_not_from_two_places(tmp_path) -> None:
    from pdserve.router.config import ConfigError, RouterConfig
    from pdserve.router.enrollment import enrollment_verifier

    issuer = EnrollmentIssuer()
    (tmp_path / "public").write_text(issuer.public_key.hex() + "\n")
    verifier = enrollment_verifier(RouterConfig(enrollment_public_key_file=str(tmp_path / "public")))
    verifier.check(issuer.issue("decode-0", "decode"), "decode-0", "decode", "10.0.0.1:1")
    for config, reason in ((RouterConfig(enrollment_public_key_file=str(tmp_path / "public"),
                                         enrollment_public_key=issuer.public_key.hex()), "give one"),
                           (RouterConfig(enrollment_public_key_file=str(tmp_path / "missing")), "cannot read"),
                           (RouterConfig(revoked_workers_file=str(tmp_path / "revoked")), "needs")):
        with pytest.raises(ConfigError, match=reason):
            enrollment_verifier(config)
