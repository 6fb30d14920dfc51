"""The cluster secret and call credentials (pdserve.security): what verifies, what does not."""
from __future__ import annotations

import os

import pytest
from support import FakeClock

from pdserve.common.errors import AuthError
from pdserve.common.util import is_loopback
from pdserve.security.credentials import CallSigner, CallVerifier
from pdserve.security.secret import ClusterSecret, ClusterSecretError, Mac, require_secret_off_loopback

METHOD = "/pdserve.v1.Decode/Decode"


@pytest.fixture
def secret(tmp_path) -> ClusterSecret:
    return ClusterSecret.create(tmp_path / "secret")


def test_secret_file_is_private_and_checked(tmp_path):
    path = tmp_path / "secret"
    ClusterSecret.create(path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    ClusterSecret.load(path)
    os.chmod(path, 0o644)
    with pytest.raises(ClusterSecretError, match="chmod 600"):
        ClusterSecret.load(path)
    with pytest.raises(ClusterSecretError, match="cannot read"):
        ClusterSecret.load(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    os.chmod(short, 0o600)
    with pytest.raises(ClusterSecretError, match="16"):
        ClusterSecret.load(short)
    with pytest.raises(FileExistsError):  # never overwrites
        ClusterSecret.create(path)
    os.chmod(path, 0o600)
    material = path.read_text().strip()
    assert material not in repr(ClusterSecret.load(path))


def test_credentials_verify_once_within_the_skew_window(secret):
    clock = FakeClock(1_000_000.0)
    signer = CallSigner(secret, "decode-0", clock=clock)
    verifier = CallVerifier(secret, max_skew_s=30, clock=clock)
    credential = signer.credential(METHOD)
    assert verifier.verify(METHOD, credential) == "decode-0"
    with pytest.raises(AuthError, match="replayed"):
        verifier.verify(METHOD, credential)
    with pytest.raises(AuthError, match="bad credential"):  # bound to the method
        verifier.verify("/pdserve.v1.Decode/Abort", signer.credential(METHOD))
    stale = signer.credential(METHOD)
    clock.now += 31
    with pytest.raises(AuthError, match="skew"):
        verifier.verify(METHOD, stale)
    assert verifier.verify(METHOD, signer.credential(METHOD)) == "decode-0"


@pytest.mark.parametrize("credential", [None, "", "v1", "v2 a 1 b c", "v1 decode-0 1 " + "0" * 32 + " " + "0" * 64,
                                        "v1 bad id 1 2 3", "v1 decode-0 notanumber " + "0" * 32 + " " + "0" * 64])
def test_malformed_or_forged_credentials_are_refused(secret, credential):
    with pytest.raises(AuthError):
        CallVerifier(secret).verify(METHOD, credential)


def test_a_credential_of_another_deployment_is_refused(secret, tmp_path):
    other = ClusterSecret.create(tmp_path / "other")
    with pytest.raises(AuthError, match="bad credential"):
        CallVerifier(secret).verify(METHOD, CallSigner(other, "decode-0").credential(METHOD))
    # a caller cannot rename itself inside a valid credential
    parts = CallSigner(secret, "decode-0").credential(METHOD).split(" ")
    parts[1] = "decode-1"
    with pytest.raises(AuthError, match="bad credential"):
        CallVerifier(secret).verify(METHOD, " ".join(parts))


def test_macs_are_per_use_and_unambiguous(secret):
    calls, handoff = Mac(secret.key("calls")), Mac(secret.key("handoff"))
    assert calls.tag("a", 1) != handoff.tag("a", 1)
    assert handoff.tag("ab", "c") != handoff.tag("a", "bc")  # length-prefixed fields
    assert handoff.check(handoff.tag("x", b"\x00"), "x", b"\x00")
    assert not handoff.check(handoff.tag("x"), "y")


def test_fail_closed_beyond_loopback(secret):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("[::1]") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")
    require_secret_off_loopback("127.0.0.1", None, False, "decode")
    require_secret_off_loopback("0.0.0.0", secret, False, "decode")
    require_secret_off_loopback("0.0.0.0", None, True, "decode")
    with pytest.raises(ClusterSecretError, match="--cluster-secret-file"):
        require_secret_off_loopback("0.0.0.0", None, False, "decode")
