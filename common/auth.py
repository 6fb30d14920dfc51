"""The cluster secret, the per-process call keys, and the credentials made from them
(DESIGN §7). No grpc here: the gRPC interceptors that carry call credentials live in
`pdserve.rpc.credentials`.

One secret per deployment, read from a file (`--cluster-secret-file`), never from a
command line. Each use gets its own key, derived as HMAC-SHA256(secret, "pdserve-v1/<use>"):

* `calls`    admission credentials (v1, below): registration and read-only calls,
* `handoff`  the decode's signature on a KV hand-off,
* `transfer` the UCX/gloo control channel's challenge-response,
* `store`    the MAC on Redis/disk KV records.

Every process (router, each prefill, each decode) also makes its own Ed25519 key pair at
start (`CallKey`); the private key never leaves the process and is never written down.

Two kinds of call credential, one per call:

* `v1 <caller_id> <unix_ms> <nonce> <mac>`: an HMAC under the `calls` key, which every
  process of the deployment holds. It admits a process to the deployment, nothing more: it
  is accepted only for `ADMISSION_METHODS` (Register, ModelInfo, Load), and its caller id
  is a label anyone with the secret can write.
* `v2 <caller_id> <unix_ms> <nonce> <sig>`: an Ed25519 signature by the caller's own key.
  Every other internal call needs one. A verifier finds the caller's public key in a
  `KeyDirectory`: the router in its registry (a worker sends its public key in Register;
  the registry binds it to the id with the lease), a worker among the routers it registered
  with (RegisterResponse) and, for a peer worker, by asking the registry (Lookup).

Both cover the full gRPC method name, the caller id, the time and the nonce. A verifier
accepts a credential within `max_skew_s` of its own clock and only once (a replay cache
keyed by nonce). The router holds what verifies workers' calls, never what signs them.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Protocol, Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from pdserve.common.errors import AuthError, PdserveError

__all__ = ["ADMISSION_METHODS", "ROUTER_ID", "AuthError", "CallKey", "CallSigner", "CallVerifier",
           "ClusterSecret", "ClusterSecretError", "Identity", "KeyDirectory", "Mac", "UnknownCallerError",
           "caller_of", "encode_fields", "is_loopback", "require_secret_off_loopback"]

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
CREDENTIAL_HEADER = "pdserve-credential"
_CALLER_ID = re.compile(r"[A-Za-z0-9._:@/\[\]-]{1,200}")
_NONCE_BYTES = 16
PUBLIC_KEY_BYTES = 32  # a raw Ed25519 public key
_SIGNATURE_BYTES = 64
ROUTER_ID = "router"  # the caller id of every router; no worker may register under it
# The calls a v1 (cluster-secret) credential is enough for: joining, and reading what a
# worker serves and how loaded it is (the router asks a decode for ModelInfo before it
# answers its Register, so before that decode can know the router's key).
ADMISSION_METHODS = frozenset({
    "/pdserve.v1.Registry/Register",
    "/pdserve.v1.Decode/ModelInfo", "/pdserve.v1.Decode/Load",
    "/pdserve.v1.Prefill/ModelInfo", "/pdserve.v1.Prefill/Load",
})


class ClusterSecretError(PdserveError):
    """The cluster secret file is missing, unreadable, too short or readable by others."""


class ClusterSecret:
    """The deployment's shared secret; `key(use)` gives a derived key per use."""

    def __init__(self, material: bytes) -> None:
        if not MIN_SECRET_BYTES <= len(material) <= MAX_SECRET_BYTES:
            raise ClusterSecretError(f"a cluster secret must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes")
        self._material = material

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ClusterSecret":
        """Read a secret file: owned by this user or root, readable by nobody else (0600 is
        right; a Kubernetes Secret volume's files, see `_on_secret_volume`, may be 0440/0644)."""
        return cls(read_private_file(path, "cluster secret").strip())
    @staticmethod
    def create(path: str | os.PathLike) -> "ClusterSecret":
        """Write a new random secret to `path` (created 0600; an existing file is an error)."""
        material = secrets.token_hex(32).encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(material + b"\n")
        return ClusterSecret(material)

    def key(self, use: str) -> bytes:
        return hmac.new(self._material, b"pdserve-v1/" + use.encode(), hashlib.sha256).digest()


_TIMESTAMPED_DIR = re.compile(r"\.\.\d{4}_\d{2}_\d{2}_\d{2}_\d{2}_\d{2}\.\d+")


def read_private_file(path: str | os.PathLike, what: str, max_bytes: int = MAX_SECRET_BYTES + 64) -> bytes:
    """The bytes of a file that holds a secret, checked on the descriptor they are read from
    (no stat-then-read race): the path's final target (symlinks resolved) is a regular file
    owned by this user or root, and neither group nor others may read or write it, unless it
    is a Kubernetes Secret volume's file (`_on_secret_volume`), which may be group- or
    world-readable, never writable."""
    given = Path(path)
    try:
        target = given.resolve(strict=True)
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, RuntimeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise ClusterSecretError(f"cannot read the {what} file {given}: {reason}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ClusterSecretError(f"the {what} file {given} is not a regular file")
        if st.st_uid not in (os.geteuid(), 0):
            raise ClusterSecretError(f"the {what} file {given} belongs to uid {st.st_uid}, neither this "
                                     f"user ({os.geteuid()}) nor root")
        mode = stat.S_IMODE(st.st_mode)
        shared, writable = mode & (stat.S_IRWXG | stat.S_IRWXO), mode & (stat.S_IWGRP | stat.S_IWOTH)
        if shared and (writable or st.st_uid != 0 or not _on_secret_volume(target)):
            raise ClusterSecretError(f"the {what} file {given} is readable by others (mode {mode:o}"
                                     f"{'' if target == given else f', via {target}'}); run: chmod 600 {target}")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ClusterSecretError(f"the {what} file {given} is over {max_bytes} bytes")
    return data


def _on_secret_volume(target: Path) -> bool:
    """True for a file Kubernetes wrote into a Secret volume: the kubelet puts it in a
    timestamped directory `..2025_01_31_12_00_00.123` on a tmpfs, which `..data` (a symlink
    beside it) points at; the files are root's, 0644 unless the volume's defaultMode says
    otherwise (this chart: 0440), in a mount only the pod sees. `target` is resolved: a
    `..data` anywhere else in a path grants nothing."""
    folder = target.parent
    if not _TIMESTAMPED_DIR.fullmatch(folder.name):
        return False
    try:
        if os.readlink(folder.parent / "..data") != folder.name:
            return False
    except OSError:
        return False
    return _filesystem_of(target) == "tmpfs"


def _filesystem_of(path: Path) -> str:
    """The type of the filesystem `path` lives on (the longest mount point above it)."""
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                mount = fields[1].replace("\\040", " ")
                if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return ""
    return kind


def encode_fields(*fields: object) -> bytes:
    """An unambiguous byte encoding of ints, strs and bytes (length-prefixed), for MACs."""
    out = bytearray()
    for field in fields:
        if isinstance(field, bool) or isinstance(field, int):
            out += b"i" + struct.pack("<q", int(field))
        elif isinstance(field, str):
            data = field.encode()
            out += b"s" + struct.pack("<I", len(data)) + data
        elif isinstance(field, (bytes, bytearray, memoryview)):
            out += b"b" + struct.pack("<I", len(field)) + bytes(field)
        else:
            raise TypeError(f"cannot encode {type(field).__name__}")
    return bytes(out)


class Mac:
    """HMAC-SHA256 under one derived key."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def tag(self, *fields: object) -> bytes:
        return hmac.new(self._key, encode_fields(*fields), hashlib.sha256).digest()

    def check(self, tag: bytes, *fields: object) -> bool:
        return hmac.compare_digest(tag, self.tag(*fields))


class UnknownCallerError(AuthError):
    """A v2 credential whose caller has no key here that verifies it (yet): the verifier's
    `KeyDirectory` may learn the key (`refresh`) and the check be tried once more. The
    message is the same for every caller (refusal reasons are metric labels)."""

    def __init__(self, message: str, caller_id: str) -> None:
        super().__init__(message)
        self.caller_id = caller_id


class CallKey:
    """This process's Ed25519 key pair, made at start. The private key never leaves the
    process: it is not written anywhere and not shown by repr."""

    def __init__(self) -> None:
        self._private = Ed25519PrivateKey.generate()
        self.public_key = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def __repr__(self) -> str:
        return f"CallKey(public={self.public_key.hex()[:16]}...)"

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)


@lru_cache(maxsize=4096)
def public_key_of(raw: bytes) -> Ed25519PublicKey:
    """A loaded public key (loading costs more than a verify; keys are few and reused).
    ValueError unless `raw` is PUBLIC_KEY_BYTES long."""
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, not {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who made a verified call: a caller id, its role ("router", "prefill", "decode"; "" for
    a v1 credential, which proves membership of the deployment only) and its public key."""

    caller_id: str
    role: str
    public_key: bytes = field(default=b"", repr=False)


class KeyDirectory(Protocol):
    """Where a verifier finds callers' public keys.

    `identities(caller_id)` answers from memory, at once: the identities that caller id may
    hold now (several for ROUTER_ID when several routers run). `refresh(caller_id)` is
    awaited after a credential of `caller_id` failed to verify with them, before the one
    retry: it may learn keys (bounded in time and rate), or do nothing."""

    def identities(self, caller_id: str) -> Sequence[Identity]: ...

    async def refresh(self, caller_id: str) -> None: ...


def _signed_text(method: str, caller: str, unix_ms: int, nonce: str) -> bytes:
    return encode_fields("pdserve-call-v2", method, caller, unix_ms, nonce)


class CallSigner:
    """Makes the credential a caller attaches to one internal RPC: v1 (the cluster secret's
    MAC) for ADMISSION_METHODS or when it has no `key`, else v2 (its own signature)."""

    def __init__(self, secret: ClusterSecret, caller_id: str, key: CallKey | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not _CALLER_ID.fullmatch(caller_id):
            raise ValueError(f"caller id {caller_id!r} has characters a credential cannot carry")
        self._mac = Mac(secret.key("calls"))
        self._key = key
        self.caller_id = caller_id
        self._clock = clock

    @property
    def public_key(self) -> bytes:
        """What verifies this signer's v2 credentials (b"": it makes v1 ones only)."""
        return self._key.public_key if self._key is not None else b""

    def credential(self, method: str) -> str:
        unix_ms = int(self._clock() * 1000)
        nonce = secrets.token_hex(_NONCE_BYTES)
        if self._key is None or method in ADMISSION_METHODS:
            mac = self._mac.tag(method, self.caller_id, unix_ms, nonce).hex()
            return f"v1 {self.caller_id} {unix_ms} {nonce} {mac}"
        signature = self._key.sign(_signed_text(method, self.caller_id, unix_ms, nonce)).hex()
        return f"v2 {self.caller_id} {unix_ms} {nonce} {signature}"


def caller_of(credential: str | None) -> str:
    """The caller id a (verified) credential names; "" if it names none."""
    parts = (credential or "").split(" ")
    return parts[1] if len(parts) == 5 else ""


_TAG_HEX = {"v1": 64, "v2": 2 * _SIGNATURE_BYTES}


class CallVerifier:
    """Checks call credentials: MAC or signature, clock skew, and that no nonce is accepted
    twice. With `keys`, v2 credentials verify against the caller's keys found there and v1
    ones only for ADMISSION_METHODS; without (unit tests, a process that learns no keys),
    only v1 credentials verify, for any method."""

    def __init__(self, secret: ClusterSecret, keys: KeyDirectory | None = None, *, max_skew_s: float = 60.0,
                 max_remembered: int = 200_000, clock: Callable[[], float] = time.time) -> None:
        self._mac = Mac(secret.key("calls"))
        self.keys = keys
        self.max_skew_s = max_skew_s
        self._max_remembered = max_remembered
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> expiry, oldest first
        self._lock = threading.Lock()

    def verify(self, method: str, credential: str | None) -> str:
        """The caller id of a valid credential for `method`; AuthError otherwise."""
        return self.check(method, credential).caller_id

    def check(self, method: str, credential: str | None) -> Identity:
        """The identity of a valid credential for `method`: AuthError otherwise, its subclass
        UnknownCallerError when no key known here verifies a well-formed v2 credential."""
        if not credential:
            raise AuthError("no credential")
        parts = credential.split(" ")
        if len(parts) != 5 or parts[0] not in _TAG_HEX or (parts[0] == "v2" and self.keys is None):
            raise AuthError("malformed credential")
        kind, caller, unix_ms, nonce, tag_hex = parts
        if not (_CALLER_ID.fullmatch(caller) and unix_ms.isdigit() and len(unix_ms) <= 16
                and len(nonce) == 2 * _NONCE_BYTES and len(tag_hex) == _TAG_HEX[kind]):
            raise AuthError("malformed credential")
        try:
            tag = bytes.fromhex(tag_hex)
        except ValueError:
            raise AuthError("malformed credential") from None
        now = self._clock()
        in_window = abs(now - int(unix_ms) / 1000) <= self.max_skew_s
        if kind == "v1":
            identity = self._check_admission(method, caller, int(unix_ms), nonce, tag)
        if not in_window:  # before a signature check: a stale credential costs no verify
            raise AuthError("credential outside the clock-skew window")
        if kind == "v2":
            identity = self._check_signature(method, caller, int(unix_ms), nonce, tag)
        self._remember(nonce, now)
        return identity

    def _check_admission(self, method: str, caller: str, unix_ms: int, nonce: str, mac: bytes) -> Identity:
        if not self._mac.check(mac, method, caller, unix_ms, nonce):
            raise AuthError("bad credential")
        if self.keys is not None and method not in ADMISSION_METHODS:
            raise AuthError("a v1 credential admits to registration, ModelInfo and Load only; "
                            "this call needs the caller's own signature (v2)")
        return Identity(caller, "")

    def _check_signature(self, method: str, caller: str, unix_ms: int, nonce: str, signature: bytes) -> Identity:
        text = _signed_text(method, caller, unix_ms, nonce)
        for identity in self.keys.identities(caller):
            try:
                public_key_of(identity.public_key).verify(signature, text)
            except (InvalidSignature, ValueError):
                continue
            return identity
        raise UnknownCallerError("no key known here verifies the caller's signature", caller)

    def _remember(self, nonce: str, now: float) -> None:
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)  # expired: outside the skew window anyway
            if nonce in self._seen:
                raise AuthError("replayed credential")
            if len(self._seen) >= self._max_remembered:
                raise AuthError("too many credentials in the skew window")
            self._seen[nonce] = now + 2 * self.max_skew_s


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; a wildcard or any other address is not."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def require_secret_off_loopback(host: str, secret: ClusterSecret | None, insecure_internal: bool,
                                role: str) -> None:
    """Fail closed: a service listening beyond loopback needs a cluster secret."""
    if secret is None and not is_loopback(host) and not insecure_internal:
        raise ClusterSecretError(
            f"{role} binds {host}, beyond loopback, without a cluster secret: anyone on the network "
            "could call its internal API. Give --cluster-secret-file PATH (a file of 32+ random "
            "bytes, mode 0600, the same on every service of this deployment; e.g. "
            "`head -c 32 /dev/urandom | base64 > secret && chmod 600 secret`), or accept the risk "
            "with --insecure-internal.")
