"""Optional API key: `Authorization: Bearer KEY` on HTTP /v1/* and as gRPC metadata
`authorization` on Generation calls. The Registry is not guarded by it (workers are inside
the deployment's network)."""
from __future__ import annotations

import hmac
from typing import Any

from pdserve.common.errors import UnauthenticatedError


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

    def check_grpc(self, context: Any) -> None:
        if self._expected is not None:
            metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
            self.check(metadata.get("authorization"))
