"""Client keys: who may use the public API, and what each caller may see.

Threat: a client without the key using the service (or guessing it by timing), a client
reading pdserve's internals (worker ids, routing, transfer verdicts, raw errors) that only
an operator should, or a call carrying two keys of which the wrong one is checked.

Rule: with an API key set, a call is served only when it carries exactly one
`Authorization: Bearer <key>` (HTTP header or gRPC `authorization` metadata), compared in
constant time (a tenant's key: looked up by its keyed digest, `tenants`), and it is checked
before the request is read. A tenant's key names its `Caller`'s tenant, whose prefix-cache
namespace and limits the request gets; the one `--api-key` is the tenant-less client. The key a caller sends sets
its `Scope`: the admin key (read from a private file, different from the API key) sees
pdserve's internals; the API key, or no key where none is asked for, sees a client's
answer only. A router with no key at all shows everyone everything only where it listens
on loopback (`pdserve up` on a laptop: `open_scope`); listening anywhere else, it has no
admin without an admin key. The HTTP check and the gRPC interceptor are adapters in `pdserve.router.api_key`.
"""
from __future__ import annotations

import enum
import hmac
import os
from dataclasses import dataclass
from typing import Iterable

from pdserve.common.errors import UnauthenticatedError
from pdserve.common.util import is_loopback
from pdserve.security.secret import read_private_file
from pdserve.security.tenants import Tenant, TenantKeys

MAX_ADMIN_KEY_BYTES = 4096


class ClientKeyError(ValueError):
    """The client keys given are unusable (the admin key equal to the API key, or not one
    word of printable ASCII)."""


class Scope(enum.IntEnum):
    """What a caller may see; each scope sees what the ones below it see.

    ANONYMOUS: /health's status. CLIENT: the OpenAI answer, usage with cached tokens, the
    request id, /health's model list and worker counts; errors raised inside the deployment
    only by kind. ADMIN: pdserve's internals besides: routing (worker ids, matched prefix
    tokens, predictions), transfer verdicts, TTFT timings, /health's per-worker backends,
    and every error as it was raised."""

    ANONYMOUS = 0
    CLIENT = 1
    ADMIN = 2


def open_scope_for(host: str) -> Scope:
    """What callers of a router with no key at all see: everything where it listens on
    loopback only (its callers are this machine's), a client's answer anywhere else."""
    return Scope.ADMIN if is_loopback(host) else Scope.CLIENT


def load_key_file(path: str | os.PathLike, what: str) -> str:
    """The key (a bearer token, a password) in `path`, a file private to this user or on a
    Secret volume (ClusterSecretError otherwise): one word of printable ASCII (ClientKeyError
    otherwise). Keys come from files so that no flag (ps) or environment shows them."""
    raw = read_private_file(path, what, max_bytes=MAX_ADMIN_KEY_BYTES)
    key = raw.decode("ascii", errors="replace").strip()
    if not key or not key.isprintable() or " " in key:
        raise ClientKeyError(f"{path}: the {what} must be one word of printable ASCII")
    return key


def load_admin_key(path: str | os.PathLike) -> str:
    """The admin key in `path` (`load_key_file`)."""
    return load_key_file(path, "admin key")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a call: what it may see, and its tenant (None: the one API key's client,
    the admin, or anyone where no key is asked for)."""

    scope: Scope
    tenant: Tenant | None = None


class ClientKeys:
    """The API key, the admin key and the tenants' keys of one router (each may be None:
    not asked for)."""

    def __init__(self, api_key: str | None, admin_api_key: str | None = None,
                 tenants: TenantKeys | None = None, open_scope: Scope = Scope.CLIENT) -> None:
        """`open_scope`: what every caller sees when no key at all is set (ADMIN only for a
        router on loopback: `open_scope_for`)."""
        if admin_api_key is not None and admin_api_key == api_key:
            raise ClientKeyError("the admin key must differ from the API key")
        self._open_scope = open_scope
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()
        self._admin = None if admin_api_key is None else f"Bearer {admin_api_key}".encode()
        self._tenants = tenants

    @property
    def enabled(self) -> bool:
        return self._expected is not None or self._tenants is not None

    def _open(self) -> bool:
        return self._expected is None and self._admin is None and self._tenants is None

    def caller(self, authorization: str | None) -> Caller:
        """Who a caller sending `authorization` is (never raises)."""
        if self._open():
            return Caller(self._open_scope)
        sent = (authorization or "").strip()
        if self._admin is not None and hmac.compare_digest(sent.encode(), self._admin):
            return Caller(Scope.ADMIN)
        if self._tenants is not None and sent.startswith("Bearer "):
            tenant = self._tenants.lookup(sent[len("Bearer "):])
            if tenant is not None:
                return Caller(Scope.CLIENT, tenant)
        if self._expected is not None and hmac.compare_digest(sent.encode(), self._expected):
            return Caller(Scope.CLIENT)
        if self._expected is None and self._tenants is None:  # an admin key only: clients are open
            return Caller(Scope.CLIENT)
        return Caller(Scope.ANONYMOUS)

    def scope(self, authorization: str | None) -> Scope:
        """What a caller sending `authorization` may see (never raises)."""
        return self.caller(authorization).scope

    def identify(self, authorization: str | None) -> Caller:
        """The caller; UNAUTHENTICATED unless `authorization` is "Bearer <a key>" (the API
        key, a tenant's or the admin's), or no client key is asked for."""
        caller = self.caller(authorization)
        if caller.scope is not Scope.ANONYMOUS:
            return caller
        if not authorization:
            raise UnauthenticatedError("missing API key: send 'Authorization: Bearer <key>'")
        raise UnauthenticatedError("incorrect API key")

    def check(self, authorization: str | None) -> Scope:
        """The caller's scope (`identify`)."""
        return self.identify(authorization).scope

    def identify_metadata(self, metadata: Iterable[tuple[str, str]] | None) -> Caller:
        """`identify` on gRPC metadata, which must carry at most one `authorization` entry."""
        if self._open():
            return Caller(self._open_scope)
        found = [value for key, value in (metadata or ()) if key.lower() == "authorization"]
        if len(found) > 1:  # the key checked must be the only one the call carries
            raise UnauthenticatedError(f"a call carries exactly one authorization entry, not {len(found)}")
        return self.identify(found[0] if found else None)

    def check_metadata(self, metadata: Iterable[tuple[str, str]] | None) -> Scope:
        """`check` on gRPC metadata (`identify_metadata`)."""
        return self.identify_metadata(metadata).scope
