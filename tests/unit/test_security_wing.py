"""The security wing stands alone: every `pdserve.security` module imports without torch and
without grpc (so the router, the CLI and any adapter can ask it), and depends only on
`pdserve.common` among pdserve's components."""
import json
import pkgutil
import subprocess
import sys

import pdserve.security

PROBE = """
import importlib, json, pkgutil, sys
import pdserve.security as wing
names = sorted(m.name for m in pkgutil.iter_modules(wing.__path__))
for name in names:
    importlib.import_module("pdserve.security." + name)
loaded = sorted({m.split(".")[1] for m in sys.modules if m.startswith("pdserve.") and m.count(".") >= 1})
print(json.dumps({"modules": names, "torch": "torch" in sys.modules, "grpc": "grpc" in sys.modules,
                  "components": loaded}))
"""


def _probe() -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_security_module_loads_neither_torch_nor_grpc():
    found = _probe()
    expected = sorted(m.name for m in pkgutil.iter_modules(pdserve.security.__path__))
    assert found["modules"] == expected and len(expected) >= 5
    assert not found["torch"], "a pdserve.security module imports torch"
    assert not found["grpc"], "a pdserve.security module imports grpc"
    assert set(found["components"]) <= {"security", "common"}, found["components"]


def test_every_security_module_opens_with_its_threat_and_rule():
    import importlib

    for info in pkgutil.iter_modules(pdserve.security.__path__):
        doc = importlib.import_module(f"pdserve.security.{info.name}").__doc__ or ""
        assert "Threat:" in doc and "Rule:" in doc, f"pdserve.security.{info.name} does not name its threat and rule"


def test_derived_keys_differ_per_use_and_derive_key_is_hmac_of_label_and_parts():
    import hashlib
    import hmac

    from pdserve.security.secret import (ClusterSecret, block_hash_key, calls_key, derive_key, handoff_key,
                                         store_key, transfer_key)

    secret = ClusterSecret(b"s" * 32)
    keys = [calls_key(secret), handoff_key(secret), transfer_key(secret), store_key(secret), block_hash_key(secret)]
    assert len(set(keys)) == len(keys)
    assert transfer_key(None) is None and store_key(None) is None
    key = transfer_key(secret)
    assert derive_key(key, b"session", b"c" * 32, b"n" * 32) == hmac.new(
        key, b"session" + b"c" * 32 + b"n" * 32, hashlib.sha256).digest()


def test_a_sealed_store_record_opens_only_under_its_own_key_and_block():
    from pdserve.security import store_records
    from pdserve.security.secret import ClusterSecret, store_key

    key, other = store_key(ClusterSecret(b"s" * 32)), store_key(ClusterSecret(b"t" * 32))
    sealed = store_records.seal(key, 7, b"record")
    assert bytes(store_records.open_sealed(key, 7, sealed)) == b"record"
    assert store_records.open_sealed(key, 8, sealed) is None  # moved under another block
    assert store_records.open_sealed(other, 7, sealed) is None  # from another deployment
    assert store_records.open_sealed(key, 7, sealed[:-1] + bytes([sealed[-1] ^ 1])) is None
    assert store_records.seal(None, 7, b"record") == b"record"
    secret_bytes = bytes(range(256)) * 4  # what a KV record holds: none of it is kept in clear
    sealed = store_records.seal(key, 7, secret_bytes)
    assert secret_bytes[:16] not in sealed and secret_bytes[500:516] not in sealed
    assert store_records.seal(key, 7, secret_bytes) != sealed  # a fresh nonce per record
    assert len(sealed) == len(secret_bytes) + store_records.sealed_overhead(True)


def test_a_live_registration_is_taken_only_with_its_lease_and_key():
    import pytest

    from pdserve.common.errors import AlreadyExistsError, AuthError, InvalidRequestError
    from pdserve.security import registration

    lease, key = registration.new_lease(), b"k" * 32
    registration.check_lease("d0", lease, lease)
    registration.check_lease("d0", lease, None)  # the router's own poll shows none
    with pytest.raises(AuthError, match="not the lease"):
        registration.check_lease("d0", lease, b"x" * 16)
    registration.check_takeover("d0", "h:1", lease, key, live_address="h:2", live_lease=lease, live_key=key)
    with pytest.raises(AlreadyExistsError, match="alive at h:2"):
        registration.check_takeover("d0", "h:2", b"", key, live_address="h:2", live_lease=lease, live_key=key)
    with pytest.raises(AlreadyExistsError, match="another key"):
        registration.check_takeover("d0", "h:2", lease, b"j" * 32, live_address="h:2", live_lease=lease,
                                    live_key=key)
    with pytest.raises(InvalidRequestError, match="routers' own"):
        registration.check_worker_key("router", key)
    with pytest.raises(InvalidRequestError, match="Ed25519"):
        registration.check_worker_key("d0", b"short")
    registration.check_acts_for("d0", "d0")
    with pytest.raises(AuthError, match="a credential of 'd1' cannot act for worker 'd0'"):
        registration.check_acts_for("d1", "d0")


def test_a_key_ring_holds_only_its_uses_and_never_the_secret(tmp_path):
    import pytest

    from pdserve.security.secret import (ROUTER_USES, ClusterSecret, ClusterSecretError, block_hash_key, calls_key,
                                         handoff_key, store_key, transfer_key, write_key_ring)

    secret = ClusterSecret(b"m" * 32)
    path = tmp_path / "router-keys"
    write_key_ring(secret, ROUTER_USES, path)
    assert oct(path.stat().st_mode & 0o777) == "0o600" and b"m" * 16 not in path.read_bytes()
    ring = ClusterSecret.load(path)
    assert calls_key(ring) == calls_key(secret) and block_hash_key(ring) == block_hash_key(secret)
    for derive in (handoff_key, transfer_key, store_key):
        with pytest.raises(ClusterSecretError, match="holds no"):
            derive(ring)
    assert "6d6d" not in repr(ring) and calls_key(secret).hex() not in repr(ring)
