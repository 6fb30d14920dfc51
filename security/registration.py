"""Registration: a worker's claim on an id and an address in a router's registry.

Threat: a second process taking over a live worker's id or address (and with them its
traffic and the key that verifies its calls), heartbeating or deregistering as another
worker, or registering under the routers' own caller id or with a key that verifies nothing.

Rule: a registration binds the worker id to a fresh random lease (`new_lease`) and, with a
cluster secret, to the public key its calls are signed with. While it lives, its id is
taken again only by the holder of its lease and its key (`check_takeover`); heartbeats and
deregistrations must show the lease, compared in constant time (`check_lease`); a worker's
credential acts only for its own id (`check_acts_for`); no worker
registers as ROUTER_ID, and its key is an Ed25519 public key (`check_worker_key`). The
registry's state (who is alive, which address is whose) and the Registry service are
adapters in `pdserve.router`.
"""
from __future__ import annotations

import hmac
import secrets

from pdserve.common.errors import AlreadyExistsError, AuthError, InvalidRequestError
from pdserve.security.credentials import PUBLIC_KEY_BYTES, ROUTER_ID

LEASE_BYTES = 16


def new_lease() -> bytes:
    """A registration's lease: what its heartbeats, deregistration and re-registration show."""
    return secrets.token_bytes(LEASE_BYTES)


def holds_lease(granted: bytes, shown: bytes) -> bool:
    """True when `shown` is the lease `granted` (b"": none was granted, nobody holds it)."""
    return bool(granted) and hmac.compare_digest(granted, shown)


def check_lease(worker_id: str, granted: bytes, shown: bytes | None) -> None:
    """AuthError when a registration has a lease and `shown` is not it (None: the router's
    own report, from polling a static worker, which shows none)."""
    if shown is not None and granted and not holds_lease(granted, shown):
        raise AuthError(f"worker {worker_id!r}: not the lease of its registration")


def check_acts_for(caller_id: str, worker_id: str) -> None:
    """AuthError unless the verified `caller_id` is the worker a registry call acts for."""
    if caller_id != worker_id:
        raise AuthError(f"a credential of {caller_id!r} cannot act for worker {worker_id!r}")


def check_takeover(worker_id: str, address: str, lease: bytes, public_key: bytes, *,
                   live_address: str, live_lease: bytes, live_key: bytes) -> None:
    """ALREADY_EXISTS unless a registration of `worker_id` at `address` may replace the live
    one (at `live_address`, with `live_lease` and `live_key`): it shows that lease (or, for
    an unleased one, comes from the same address), and it brings the same key."""
    if not holds_lease(live_lease, lease) and (live_lease or live_address != address):
        raise AlreadyExistsError(f"worker id {worker_id!r} is alive at {live_address}", param="worker_id")
    if not hmac.compare_digest(live_key, public_key):
        raise AlreadyExistsError(f"worker id {worker_id!r} is alive with another key", param="worker_id")


def check_worker_key(worker_id: str, public_key: bytes) -> None:
    """InvalidRequestError unless a worker may register `worker_id` with `public_key`."""
    if worker_id == ROUTER_ID:
        raise InvalidRequestError(f"worker id {ROUTER_ID!r} is the routers' own", param="worker_id")
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise InvalidRequestError(f"public_key must be an Ed25519 public key ({PUBLIC_KEY_BYTES} bytes)",
                                  param="public_key")
