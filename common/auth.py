"""The cluster secret and everything derived from it (DESIGN §7). No grpc here: the gRPC
interceptors that carry call credentials live in `pdserve.rpc.credentials`.

One secret per deployment, read from a file (`--cluster-secret-file`), never from a
command line. Each use gets its own key, derived as HMAC-SHA256(secret, "pdserve-v1/<use>"):

* `calls`    per-call credentials of internal RPCs (`CallSigner` / `CallVerifier`),
* `handoff`  the decode's signature on a KV hand-off,
* `transfer` the UCX/gloo control channel's challenge-response,
* `store`    the MAC on Redis/disk KV records.

A call credential is the text `v1 <caller_id> <unix_ms> <nonce> <mac>`; the MAC covers the
full gRPC method name, the caller id, the time and the nonce. A verifier accepts it within
`max_skew_s` of its own clock and only once (a replay cache keyed by nonce).
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
from pathlib import Path
from typing import Callable

from pdserve.common.errors import AuthError, PdserveError

__all__ = ["AuthError", "CallSigner", "CallVerifier", "ClusterSecret", "ClusterSecretError", "Mac",
           "caller_of", "encode_fields", "is_loopback", "require_secret_off_loopback"]

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
CREDENTIAL_HEADER = "pdserve-credential"
_CALLER_ID = re.compile(r"[A-Za-z0-9._:@/\[\]-]{1,200}")
_NONCE_BYTES = 16


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


class CallSigner:
    """Makes the credential a caller attaches to one internal RPC."""

    def __init__(self, secret: ClusterSecret, caller_id: str,
                 clock: Callable[[], float] = time.time) -> None:
        if not _CALLER_ID.fullmatch(caller_id):
            raise ValueError(f"caller id {caller_id!r} has characters a credential cannot carry")
        self._mac = Mac(secret.key("calls"))
        self.caller_id = caller_id
        self._clock = clock

    def credential(self, method: str) -> str:
        unix_ms = int(self._clock() * 1000)
        nonce = secrets.token_hex(_NONCE_BYTES)
        mac = self._mac.tag(method, self.caller_id, unix_ms, nonce).hex()
        return f"v1 {self.caller_id} {unix_ms} {nonce} {mac}"


def caller_of(credential: str | None) -> str:
    """The caller id a (verified) credential names; "" if it names none."""
    parts = (credential or "").split(" ")
    return parts[1] if len(parts) == 5 else ""


class CallVerifier:
    """Checks call credentials: MAC, clock skew, and that no nonce is accepted twice."""

    def __init__(self, secret: ClusterSecret, *, max_skew_s: float = 60.0, max_remembered: int = 200_000,
                 clock: Callable[[], float] = time.time) -> None:
        self._mac = Mac(secret.key("calls"))
        self.max_skew_s = max_skew_s
        self._max_remembered = max_remembered
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> expiry, oldest first
        self._lock = threading.Lock()

    def verify(self, method: str, credential: str | None) -> str:
        """The caller id of a valid credential for `method`; AuthError otherwise."""
        if not credential:
            raise AuthError("no credential")
        parts = credential.split(" ")
        if len(parts) != 5 or parts[0] != "v1":
            raise AuthError("malformed credential")
        _, caller, unix_ms, nonce, mac_hex = parts
        if not (_CALLER_ID.fullmatch(caller) and unix_ms.isdigit() and len(unix_ms) <= 16
                and len(nonce) == 2 * _NONCE_BYTES and len(mac_hex) == 64):
            raise AuthError("malformed credential")
        try:
            mac = bytes.fromhex(mac_hex)
        except ValueError:
            raise AuthError("malformed credential") from None
        if not self._mac.check(mac, method, caller, int(unix_ms), nonce):
            raise AuthError("bad credential")
        now = self._clock()
        if abs(now - int(unix_ms) / 1000) > self.max_skew_s:
            raise AuthError("credential outside the clock-skew window")
        self._remember(nonce, now)
        return caller

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
