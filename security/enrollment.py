"""Enrollment: the credential a worker joins a deployment with, issued to it alone.

Threat: anyone holding the cluster secret (every pod mounts it; a stolen copy) starting a
process that registers under a fresh worker id, role and address and so receives prompts
(a decode) or computes the KV of others (a prefill); a compromised router minting worker
identities; a worker that must be shut out for good without rotating anything else.

Rule: with enrollment on (the router's `--enrollment-public-key`), Register is accepted
only with an enrollment token (`pdserve-enrollment` metadata) signed by the deployment's
enrollment key, an Ed25519 key that only the launcher (`pdserve up`, which makes one per
start and keeps it in memory) or, in the chart, the enroller (`security.enroller`, its key
in a Secret no other pod mounts) holds: the router holds its public half, which verifies
tokens and mints none. A token names one worker id, its role and the host its address must
be on ("*": any host); a Register whose worker id, role or address differ is refused
(`EnrollmentVerifier.check`). One token registers at most `max_registrations` times (a
restarted worker registers again with its token, a copy of it cannot go on for ever), and a
worker id can be revoked (removed from the registry and refused from then on). The shared
secret alone then admits to nothing that serves a request.
"""
from __future__ import annotations

import binascii
import secrets
import threading

from cryptography.exceptions import InvalidSignature
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (Encoding, NoEncryption, PrivateFormat, PublicFormat,
                                                          load_pem_private_key, load_pem_public_key)

from pdserve.common.errors import AuthError
from pdserve.common.util import encode_fields
from pdserve.security.credentials import _CALLER_ID, public_key_of

ENROLLMENT_HEADER = "pdserve-enrollment"
MAX_TOKEN_CHARS = 1024
DEFAULT_MAX_REGISTRATIONS = 64
_TOKEN_ID_BYTES = 16
_KIND = "e1"
ANY_HOST = "*"
MAX_KEY_FILE_BYTES = 8192


class EnrollmentError(AuthError):
    """A Register without a token this router accepts for what it registers."""


def _signed(worker_id: str, role: str, host: str, token_id: str) -> bytes:
    return encode_fields("pdserve-enrollment-v1", worker_id, role, host, token_id)


class EnrollmentIssuer:
    """The enrollment key and the tokens it issues. `pdserve up` makes one per start and never
    writes it down; the chart's enroller loads one from its Secret (`load`)."""

    def __init__(self, private: Ed25519PrivateKey | None = None) -> None:
        self._private = private or Ed25519PrivateKey.generate()
        self.public_key = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @classmethod
    def load(cls, path: str) -> "EnrollmentIssuer":
        """The key of a private file holding a PEM (PKCS#8) Ed25519 private key; ValueError else."""
        from pdserve.security.secret import ClusterSecretError, read_private_file

        try:
            data = read_private_file(path, "enrollment key", max_bytes=MAX_KEY_FILE_BYTES)
            key = load_pem_private_key(data, password=None)
        except (ClusterSecretError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable PEM Ed25519 private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path}: the enrollment key must be Ed25519")
        return cls(key)

    def private_pem(self) -> bytes:
        return self._private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())

    def public_pem(self) -> bytes:
        return self._private.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)

    def __repr__(self) -> str:
        return f"EnrollmentIssuer(public={self.public_key.hex()[:16]}...)"

    def issue(self, worker_id: str, role: str, host: str = ANY_HOST) -> str:
        """A token for `worker_id` in `role` whose address is on `host` (ANY_HOST: any)."""
        if not _CALLER_ID.fullmatch(worker_id) or " " in host or not host:
            raise ValueError(f"cannot issue a token for {worker_id!r} on {host!r}")
        token_id = secrets.token_hex(_TOKEN_ID_BYTES)
        signature = self._private.sign(_signed(worker_id, role, host, token_id)).hex()
        return f"{_KIND} {worker_id} {role} {host} {token_id} {signature}"


def load_public_key(text: str) -> bytes:
    """The raw enrollment public key written as hex, as a PEM public key or inside a PEM
    certificate (what the chart's Secret holds: Helm can make a certificate of a key, not
    print its public half). ValueError unless it is an Ed25519 key."""
    text = text.strip()
    try:
        if "-----BEGIN CERTIFICATE-----" in text:
            key = x509.load_pem_x509_certificate(text.encode("ascii")).public_key()
        elif "-----BEGIN PUBLIC KEY-----" in text:
            key = load_pem_public_key(text.encode("ascii"))
        else:
            return public_key_of(bytes.fromhex(text)).public_bytes(Encoding.Raw, PublicFormat.Raw)
    except (TypeError, ValueError, UnicodeEncodeError):
        raise ValueError("the enrollment public key is hex, a PEM public key or a PEM certificate") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("the enrollment public key must be Ed25519")
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _host_of(address: str) -> str:
    host = address.rpartition(":")[0]
    return host.strip("[]")


class EnrollmentVerifier:
    """The router's check of enrollment tokens: signature, the fields they bind, how often
    each was used, and revoked worker ids."""

    def __init__(self, public_key: bytes, max_registrations: int = DEFAULT_MAX_REGISTRATIONS) -> None:
        self._key = public_key_of(public_key)  # ValueError unless an Ed25519 public key
        self._max_registrations = max_registrations
        self._uses: dict[str, int] = {}  # token id -> registrations accepted
        self._revoked: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def from_hex(cls, text: str, max_registrations: int = DEFAULT_MAX_REGISTRATIONS) -> "EnrollmentVerifier":
        """From the key as hex, a PEM public key or a PEM certificate (`load_public_key`)."""
        return cls(load_public_key(text), max_registrations)

    def revoke(self, worker_id: str) -> None:
        """Refuse every later Register of `worker_id` (the registry removes the live one)."""
        with self._lock:
            self._revoked.add(worker_id)

    def is_revoked(self, worker_id: str) -> bool:
        return worker_id in self._revoked

    def check(self, token: str | None, worker_id: str, role: str, address: str) -> None:
        """EnrollmentError unless `token` enrolls `worker_id` in `role` at `address`, is not
        used up, and the worker is not revoked. Counts one registration of the token."""
        parts = (token or "").split(" ")
        if len(token or "") > MAX_TOKEN_CHARS or len(parts) != 6 or parts[0] != _KIND:
            raise EnrollmentError("registering needs this worker's own enrollment token; the cluster "
                                  "secret alone admits no worker")
        _, named_id, named_role, host, token_id, signature = parts
        try:
            self._key.verify(binascii.unhexlify(signature), _signed(named_id, named_role, host, token_id))
        except (InvalidSignature, binascii.Error, ValueError):
            raise EnrollmentError("the enrollment token is not signed by this deployment's enrollment key") from None
        if named_id != worker_id or named_role != role:
            raise EnrollmentError(f"the enrollment token is {named_id!r}'s as a {named_role}, not "
                                  f"{worker_id!r}'s as a {role}")
        if host != ANY_HOST and _host_of(address) != host:
            raise EnrollmentError(f"the enrollment token of {worker_id!r} binds host {host}, not {address}")
        with self._lock:
            if worker_id in self._revoked:
                raise EnrollmentError(f"worker {worker_id!r} is revoked")
            used = self._uses.get(token_id, 0)
            if used >= self._max_registrations:
                raise EnrollmentError(f"the enrollment token of {worker_id!r} is used up ({used} registrations)")
            self._uses[token_id] = used + 1
