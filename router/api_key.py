"""The router's edge of client keys: `security.client_keys` keeps the rule (who may call,
what each key sees); this reads the router's settings into it and checks gRPC calls to
Generation before their request message is received (`ApiKeyInterceptor`; HTTP /v1/* is
checked before the body in `http_api`). The Registry is not guarded by it (workers are
inside the deployment's network)."""
from __future__ import annotations

from typing import Callable, Iterable

import grpc

from pdserve.common.errors import UnauthenticatedError
from pdserve.router.config import ConfigError, RouterConfig
from pdserve.rpc.server import refuse_unread
from pdserve.security.client_keys import ClientKeyError, ClientKeys, load_admin_key, open_scope_for
from pdserve.security.tenants import TenantKeys, TenantKeysError


def client_keys(config: RouterConfig) -> ClientKeys:
    """The keys of `config`; the admin key and the tenants' keys are read from their files
    (private to this user)."""
    try:
        admin = load_admin_key(config.admin_api_key_file) if config.admin_api_key_file else None
        tenants = TenantKeys(config.api_keys_file) if config.api_keys_file else None
        return ClientKeys(config.api_key, admin, tenants, open_scope_for(config.host))
    except (ClientKeyError, TenantKeysError) as exc:
        raise ConfigError(str(exc)) from None


def metrics_bearer(config: RouterConfig) -> str | None:
    """The one bearer /metrics answers (HTTP and --metrics-port): the metrics token where
    one is set (what a scraper holds: it names workers and their cache hits), else the API
    key under --metrics-auth; None: open."""
    if config.metrics_token:
        return config.metrics_token
    return config.api_key if config.metrics_auth else None


def check_metrics_bearer(config: RouterConfig, authorization: str | None) -> None:
    """UNAUTHENTICATED unless `authorization` is /metrics' bearer (`metrics_bearer`), compared
    in constant time; nothing to check where /metrics is open."""
    import hmac

    bearer = metrics_bearer(config)
    if bearer is not None and not hmac.compare_digest((authorization or "").strip().encode(),
                                                      f"Bearer {bearer}".encode()):
        raise UnauthenticatedError("/metrics needs its bearer token: send 'Authorization: Bearer <token>'")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call to a `protected` service (full names, e.g. "pdserve.v1.Generation")
    without the API key, with UNAUTHENTICATED, before its request message is received: a
    refused call costs its headers and at most one HTTP/2 stream window, whatever its size.
    Other services (health checking, reflection: probes) stay open. `on_refused(err)` counts
    each refusal."""

    def __init__(self, check: ClientKeys, protected: Iterable[str],
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
