"""Optional API key: `Authorization: Bearer KEY` on HTTP /v1/* and as gRPC metadata
`authorization` on Generation calls. The Registry is not guarded by it (workers are inside
the deployment's network).

Both edges check the key before reading a request: HTTP before the body, gRPC in
`ApiKeyInterceptor`, before the request message is received."""
from __future__ import annotations

import hmac
from typing import Callable, Iterable

import grpc

from pdserve.common.errors import UnauthenticatedError
from pdserve.rpc.server import refuse_unread


class ApiKeyCheck:
    def __init__(self, api_key: str | None) -> None:
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()

    @property
    def enabled(self) -> bool:
        return self._expected is not None

    def check(self, authorization: str | None) -> None:
        """UNAUTHENTICATED unless `authorization` is "Bearer <the key>" (or no key is set)."""
        if self._expected is None:
            return
        if not authorization:
            raise UnauthenticatedError("missing API key: send 'Authorization: Bearer <key>'")
        if not hmac.compare_digest(authorization.strip().encode(), self._expected):
            raise UnauthenticatedError("incorrect API key")

    def check_metadata(self, metadata: Iterable[tuple[str, str]] | None) -> None:
        """`check` on gRPC metadata, which must carry exactly one `authorization` entry."""
        if self._expected is None:
            return
        found = [value for key, value in (metadata or ()) if key.lower() == "authorization"]
        if len(found) > 1:  # the key checked must be the only one the call carries
            raise UnauthenticatedError(f"a call carries exactly one authorization entry, not {len(found)}")
        self.check(found[0] if found else None)


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
