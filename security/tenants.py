"""Tenants: several API keys, each naming the client (tenant) that holds it.

Threat: one client learning another's prompts through the prefix cache (`cached_tokens`, or
TTFT, says whether a guessed prefix was cached by someone), one client's burst taking the
service from the others, or a key change needing a restart (and so waiting).

Rule: the keys file (`--api-keys-file`, private to this user) holds lines `TENANT KEY
[requests_per_minute=N] [tokens_per_minute=N] [in_flight=N]`; `#` starts a comment. A key
is looked up by its keyed digest (the time taken says nothing of how much of it matched),
and the file is read again when it changes (`TenantKeys.lookup` checks at most once per
`recheck_s`); a file that no longer parses leaves the last good table in force. Each tenant
prefix-caches in its own namespace: its block hashes are salted with its name
(`tenant_cache_salt`), on top of a request's own `cache_salt`, so a tenant's prefixes never
hit another's. Each tenant's limits are enforced by `pdserve.router.tenant_limits`.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from pdserve.common.util import encode_fields
from pdserve.security.secret import ClusterSecretError, read_private_file

log = logging.getLogger(__name__)

MAX_KEYS_FILE_BYTES = 1 << 20
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")
LIMIT_NAMES = ("requests_per_minute", "tokens_per_minute", "in_flight")


class TenantKeysError(ValueError):
    """The keys file does not parse (the line and what is wrong with it)."""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's limits; 0 is no limit."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0  # prompt tokens plus max_tokens, charged at admission
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    limits: TenantLimits = field(default_factory=TenantLimits)


def tenant_cache_salt(tenant: str, cache_salt: str) -> str:
    """The salt a tenant's request is hashed under: its tenant's namespace and then the
    request's own `cache_salt` (fixed length: within common.block_hash's bound)."""
    return "tenant:" + hashlib.blake2b(encode_fields("pdserve-tenant-v1", tenant, cache_salt),
                                       digest_size=24).hexdigest()


def _parse_line(number: int, line: str) -> tuple[str, Tenant] | None:
    words = line.split("#", 1)[0].split()
    if not words:
        return None
    if len(words) < 2:
        raise TenantKeysError(f"line {number}: expected 'TENANT KEY [limit=N ...]'")
    name, key, *options = words
    if not _TENANT.fullmatch(name):
        raise TenantKeysError(f"line {number}: a tenant name is 1-64 of A-Z a-z 0-9 . _ -")
    if not key.isprintable() or not key.isascii():
        raise TenantKeysError(f"line {number}: a key is one word of printable ASCII")
    limits: dict[str, int] = {}
    for option in options:
        limit, _, value = option.partition("=")
        if limit not in LIMIT_NAMES or not value.isdigit():
            raise TenantKeysError(f"line {number}: unknown option {limit!r} (one of {', '.join(LIMIT_NAMES)}=N)")
        limits[limit] = int(value)
    return key, Tenant(name, TenantLimits(**limits))


def parse_keys(text: str, digest: Callable[[str], bytes]) -> dict[bytes, Tenant]:
    """The table of a keys file's text: digest(key) -> its tenant. TenantKeysError on a bad
    line or a key given twice (one key names one tenant)."""
    table: dict[bytes, Tenant] = {}
    for number, line in enumerate(text.splitlines(), 1):
        parsed = _parse_line(number, line)
        if parsed is None:
            continue
        key, tenant = parsed
        if digest(key) in table:
            raise TenantKeysError(f"line {number}: this key is given twice")
        table[digest(key)] = tenant
    return table


def first_key(path: str | os.PathLike) -> str | None:
    """The first key of a keys file (None: it holds none), for the launcher's own checks."""
    raw = read_private_file(path, "API keys", max_bytes=MAX_KEYS_FILE_BYTES)
    for number, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        parsed = _parse_line(number, line)
        if parsed is not None:
            return parsed[0]
    return None


class TenantKeys:
    """The tenants of a keys file, read again when the file changes."""

    def __init__(self, path: str | os.PathLike, recheck_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._path = path
        self._recheck_s = recheck_s
        self._clock = clock
        self._pepper = secrets.token_bytes(32)
        self._stamp: tuple | None = None
        self._checked = float("-inf")
        self._table = self._read()  # the first read must succeed: a start with a bad file fails

    def _digest(self, key: str) -> bytes:
        return hmac.new(self._pepper, key.encode(), hashlib.sha256).digest()

    def _file_stamp(self) -> tuple | None:
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns)

    def _read(self) -> dict[bytes, Tenant]:
        self._stamp = self._file_stamp()
        raw = read_private_file(self._path, "API keys", max_bytes=MAX_KEYS_FILE_BYTES)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise TenantKeysError(f"{self._path}: not UTF-8 text") from None
        try:
            return parse_keys(text, self._digest)
        except TenantKeysError as exc:
            raise TenantKeysError(f"{self._path}: {exc}") from None

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked < self._recheck_s:
            return
        self._checked = now
        if self._file_stamp() == self._stamp:
            return
        try:
            self._table = self._read()
            log.info("API keys file %s read again: %d keys", self._path, len(self._table))
        except (TenantKeysError, ClusterSecretError) as exc:
            log.error("API keys file changed but is refused (the previous keys stay in force): %s", exc)

    def __len__(self) -> int:
        return len(self._table)

    def lookup(self, key: str) -> Tenant | None:
        """The tenant whose key is `key` (None: no tenant's)."""
        self._maybe_reload()
        return self._table.get(self._digest(key))
