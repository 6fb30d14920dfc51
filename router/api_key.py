"""Optional API key: `Authorization: Bearer KEY` on HTTP /v1/* and as gRPC metadata
`authorization` on Generation calls. The Registry is not guarded by it (workers are inside
the deployment's network).

Both edges check the key before reading a request: HTTP before the body, gRPC in
`ApiKeyInterceptor`, before the request message is received.

The key a caller sends also sets what it sees (`Scope`): the admin key
(`--admin-api-key-file`) shows pdserve's internals; the API key, or no key where none is
asked for, shows a client's answer only. A router with neither key shows everyone
everything (`pdserve up` on a laptop)."""
from __future__ import annotations

import enum
import hmac
from typing import Callable, Iterable

import grpc

from pdserve.security.secret import read_private_file
from pdserve.common.errors import UnauthenticatedError
from pdserve.router.config import ConfigError, RouterConfig
from pdserve.rpc.server import refuse_unread

MAX_ADMIN_KEY_BYTES = 4096


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


class ApiKeyCheck:
    def __init__(self, api_key: str | None, admin_api_key: str | None = None) -> None:
        if admin_api_key is not None and admin_api_key == api_key:
            raise ConfigError("the admin key must differ from the API key")
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()
        self._admin = None if admin_api_key is None else f"Bearer {admin_api_key}".encode()

    @classmethod
    def from_config(cls, config: RouterConfig) -> "ApiKeyCheck":
        """The keys of `config`; the admin key is read from its file (private to this user)."""
        if not config.admin_api_key_file:
            return cls(config.api_key)
        raw = read_private_file(config.admin_api_key_file, "admin API key", max_bytes=MAX_ADMIN_KEY_BYTES)
        key = raw.decode("ascii", errors="replace").strip()
        if not key or not key.isprintable() or " " in key:
            raise ConfigError(f"{config.admin_api_key_file}: the admin key must be one word of printable ASCII")
        return cls(config.api_key, key)

    @property
    def enabled(self) -> bool:
        return self._expected is not None

    def scope(self, authorization: str | None) -> Scope:
        """What a caller sending `authorization` may see (never raises)."""
        if self._expected is None and self._admin is None:
            return Scope.ADMIN
        sent = (authorization or "").strip().encode()
        if self._admin is not None and hmac.compare_digest(sent, self._admin):
            return Scope.ADMIN
        if self._expected is None or hmac.compare_digest(sent, self._expected):
            return Scope.CLIENT
        return Scope.ANONYMOUS

    def check(self, authorization: str | None) -> Scope:
        """The caller's scope; UNAUTHENTICATED unless `authorization` is "Bearer <the key>"
        or "Bearer <the admin key>" (or no API key is set)."""
        scope = self.scope(authorization)
        if scope is not Scope.ANONYMOUS:
            return scope
        if not authorization:
            raise UnauthenticatedError("missing API key: send 'Authorization: Bearer <key>'")
        raise UnauthenticatedError("incorrect API key")

    def check_metadata(self, metadata: Iterable[tuple[str, str]] | None) -> Scope:
        """`check` on gRPC metadata, which must carry at most one `authorization` entry."""
        if self._expected is None and self._admin is None:
            return Scope.ADMIN
        found = [value for key, value in (metadata or ()) if key.lower() == "authorization"]
        if len(found) > 1:  # the key checked must be the only one the call carries
            raise UnauthenticatedError(f"a call carries exactly one authorization entry, not {len(found)}")
        return self.check(found[0] if found else None)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call to a `protected` service (full names, e.g. "pdserve.v1.Generation")
    without the API key, with UNAUTHENTICATED, before its request message is received: a
    refused call costs its headers and at most one HTTP/2 stream window, whatever its size.
    Other services (health checking, reflection: probes) stay open. `on_refused(err)` counts
    each refusal."""

    def __init__(self, check: ApiKeyCheck, protected: Iterable[str],
                 on_refused: Callable[[UnauthenticatedError], None] = lambda err: None) -> None:
        self._check = check
        self._protected = frozenset(protected)
        self._on_refused = on_refused

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if details.method.lstrip("/").split("/", 1)[0] not in self._protected:
            return handler
        try:
            self._check.check_metadata(details.invocation_metadata)
        except UnauthenticatedError as err:
            self._on_refused(err)
            return refuse_unread(handler, err)
        return handler
