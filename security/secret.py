"""The cluster secret and the keys derived from it.

Threat: the one secret that makes a process a member of the deployment is read by someone
else (a file others can read, a command line `ps` shows, a log line), or a tag made for one
purpose is accepted for another (a hand-off's MAC passing as a store record's).

Rule: one secret per deployment, read only from a file private to this user (or a
Kubernetes Secret volume's), never from a command line, never shown by repr. Nothing uses
the secret itself: each use gets its own key, HMAC-SHA256(secret, "pdserve-v1/<use>"), and
only this module derives them (`calls_key`, `handoff_key`, `transfer_key`, `store_key`,
`block_hash_key`; `derive_key` for keys derived from those, such as a connection's session
key). A service that listens beyond loopback without a secret refuses to start unless told
to accept the risk (`require_secret_off_loopback`). A process that needs only some keys gets
a `KeyRing` file of those instead of the secret (`pdserve up` gives its router ROUTER_USES).
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import stat
from pathlib import Path

from pdserve.common.block_hash import INSECURE_KEY
from pdserve.common.errors import PdserveError
from pdserve.common.util import encode_fields, is_loopback

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
# The uses of the secret, one derived key each.
USE_CALLS = "calls"  # admission credentials (v1): registration and read-only calls
USE_HANDOFF = "handoff"  # the decode's signature on a KV hand-off
USE_TRANSFER = "transfer"  # the UCX/gloo control channel's challenge-response
USE_STORE = "store"  # the MAC on Redis/disk KV records
USE_BLOCK_HASH = "block-hash"  # the key of the prompt blocks' digests
# What turning the secret off gives away, said when a service runs beyond loopback without one.
INSECURE_INTERNAL_OFF = (
    "these are OFF for anyone who can reach this host: internal gRPC authentication (any caller may "
    "register, heartbeat, decode, prefill or abort as any worker), hand-off signatures (a prefill sends KV "
    "wherever a hand-off says), the KV transfer challenge and the MACs on transfer frames and payloads "
    "(anyone may write KV into a decode's reserved blocks), and the MACs on Redis/disk prefix-store records "
    "(a planted record is served as cached KV)")


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
        right; a Kubernetes Secret volume's files, see `_on_secret_volume`, may be 0440/0644).
        A key ring file (`KeyRing`) loads as the key ring it is."""
        raw = read_private_file(path, "cluster secret")
        if raw.startswith(KEY_RING_MAGIC):
            return KeyRing.parse(raw, path)
        return cls(raw.strip())

    def key_ring(self, uses: tuple[str, ...]) -> bytes:
        """The text of a key ring file holding this secret's keys for `uses` only."""
        return KEY_RING_MAGIC + b"".join(f"{use} {self.key(use).hex()}\n".encode() for use in uses)

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


KEY_RING_MAGIC = b"pdserve-key-ring-v1\n"
# What a router needs: to check admission credentials (and make its own to read workers'
# ModelInfo and Load), and to hash prompt blocks as the workers do. Not the hand-off, transfer
# or store keys, and not the secret they all come from.
ROUTER_USES = (USE_CALLS, USE_BLOCK_HASH)


class KeyRing(ClusterSecret):
    """Some of a secret's derived keys, not the secret: a process holding it uses those and
    can derive no other (`key` of another use is a ClusterSecretError)."""

    def __init__(self, keys: dict[str, bytes]) -> None:  # holds no secret: ClusterSecret's __init__ is not run
        self._keys = dict(keys)

    def __repr__(self) -> str:
        return f"KeyRing({', '.join(sorted(self._keys))}: <hidden>)"

    @classmethod
    def parse(cls, raw: bytes, path: str | os.PathLike = "key ring") -> "KeyRing":
        keys = {}
        for line in raw[len(KEY_RING_MAGIC):].decode("ascii", errors="replace").splitlines():
            use, _, value = line.strip().partition(" ")
            try:
                key = bytes.fromhex(value)
            except ValueError:
                key = b""
            if len(key) != 32 or not use:
                raise ClusterSecretError(f"{path}: a key ring line is '<use> <64 hex digits>'")
            keys[use] = key
        return cls(keys)

    def key(self, use: str) -> bytes:
        if use not in self._keys:
            raise ClusterSecretError(f"this process holds no {use!r} key (its key ring: {', '.join(sorted(self._keys))})")
        return self._keys[use]


def write_private_file(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path`, 0600, replacing it whole if it exists (a reader never sees part)."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_key_ring(secret: ClusterSecret, uses: tuple[str, ...], path: str | os.PathLike) -> None:
    """Write `secret`'s keys for `uses` to `path` (0600, replaced whole if it exists)."""
    write_private_file(path, secret.key_ring(uses))


def derive_key(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256(key, label || parts...): a key (or a proof) derived from a derived key,
    for one label. Callers choose labels that no other use of `key` shares, and parts of
    fixed length (the concatenation is not length-prefixed)."""
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def calls_key(secret: ClusterSecret) -> bytes:
    return secret.key(USE_CALLS)


def handoff_key(secret: ClusterSecret) -> bytes:
    return secret.key(USE_HANDOFF)


def transfer_key(secret: ClusterSecret | None) -> bytes | None:
    """The transfer control channel's key; None without a secret (keyless frames)."""
    return secret.key(USE_TRANSFER) if secret is not None else None


def store_key(secret: ClusterSecret | None) -> bytes | None:
    """The store records' MAC key; None without a secret (records carry no MAC)."""
    return secret.key(USE_STORE) if secret is not None else None


def block_hash_key(secret: ClusterSecret | None) -> bytes:
    """The block-hash key of a deployment: derived from its secret, or the public
    `INSECURE_KEY` when it has none."""
    return secret.key(USE_BLOCK_HASH) if secret is not None else INSECURE_KEY


class Mac:
    """HMAC-SHA256 under one derived key, over fields encoded without ambiguity."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def tag(self, *fields: object) -> bytes:
        return hmac.new(self._key, encode_fields(*fields), hashlib.sha256).digest()

    def check(self, tag: bytes, *fields: object) -> bool:
        return hmac.compare_digest(tag, self.tag(*fields))


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
