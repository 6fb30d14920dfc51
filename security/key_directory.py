"""A worker's directory of call keys (a `KeyDirectory`): whose key verifies a credential
that names a caller id.

Threat: a worker taking a forged credential for a peer's because it learned the wrong key,
or made to flood its registry with key lookups by credentials naming unknown ids.

Rule: a key comes only from a router this worker registered with, never from the caller:

* ROUTER_ID: the key each router sent in its RegisterResponse, one per router address this
  worker is registered with; never asked of anyone (no registry answers for "router"). A
  router may call the moment it registered us, before its answer arrived: while a Register
  is in flight (or none has been answered), a "router" credential waits for it, briefly and
  at most `max_router_waits` at a time.
* any other id: a peer worker, asked of the registries this worker is registered with
  (`Registry.Lookup`), kept for `ttl_s`; asked again when a credential does not verify with
  what is kept (the peer restarted with a new key), at most once per `min_refresh_s` per id
  and with at most `max_lookups` lookups in flight, so forged credentials cannot make a
  worker flood its registry. When no registry answers (a partition), a key already known
  stays in use: only a registry's answer ends it.

A `Lookup` returns the registry's identity for an id, None when the registry has none, and
raises ConnectionError when the registry did not answer.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Awaitable, Callable, Sequence

from pdserve.security.credentials import ROUTER_ID, Identity

log = logging.getLogger("pdserve.auth")

Lookup = Callable[[str], Awaitable["Identity | None"]]


class PeerKeys:
    """A worker's `KeyDirectory` (see the module's docstring)."""

    def __init__(self, *, ttl_s: float = 30.0, min_refresh_s: float = 1.0, max_entries: int = 4096,
                 max_lookups: int = 4, lookup_timeout_s: float = 2.0, router_wait_s: float = 2.0,
                 max_router_waits: int = 8, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._min_refresh_s = min_refresh_s
        self._max_entries = max_entries
        self._max_lookups = max_lookups
        self._lookup_timeout_s = lookup_timeout_s
        self._router_wait_s = router_wait_s
        self._max_router_waits = max_router_waits
        self._num_router_waits = 0
        self._registering: set[str] = set()  # router addresses with a Register in flight
        self._clock = clock
        self._routers: dict[str, bytes] = {}  # router address -> its public key
        self._sources: dict[str, Lookup] = {}  # router address -> its registry's Lookup
        self._peers: OrderedDict[str, tuple[Identity | None, float]] = OrderedDict()  # id -> (None: unknown, when)
        self._pending: dict[str, asyncio.Task] = {}  # id -> its lookup in flight
        self._router_changed: asyncio.Event | None = None

    def registering(self, address: str, in_flight: bool) -> None:
        """A Register to the router at `address` was sent (True) or has ended (False)."""
        if in_flight:
            self._registering.add(address)
        else:
            self._registering.discard(address)

    def set_router(self, address: str, public_key: bytes, lookup: Lookup) -> None:
        """The router at `address` accepted our registration: its key verifies "router"
        calls, and its registry answers lookups."""
        self._routers[address] = public_key
        self._sources[address] = lookup
        self._registering.discard(address)
        if self._router_changed is not None:
            self._router_changed.set()
            self._router_changed = None

    def forget_router(self, address: str) -> None:
        self._routers.pop(address, None)
        self._sources.pop(address, None)

    def identities(self, caller_id: str) -> Sequence[Identity]:
        if caller_id == ROUTER_ID:
            return [Identity(ROUTER_ID, "router", key) for key in self._routers.values() if key]
        entry = self._peers.get(caller_id)
        if entry is None or entry[0] is None or self._clock() - entry[1] > self._ttl_s:
            return ()
        return (entry[0],)

    async def refresh(self, caller_id: str) -> None:
        if caller_id == ROUTER_ID:
            await self._wait_first_router()
            return
        entry = self._peers.get(caller_id)
        if entry is not None and self._clock() - entry[1] < self._min_refresh_s:
            return  # asked moments ago
        task = self._pending.get(caller_id)
        if task is None:
            if len(self._pending) >= self._max_lookups or not self._sources:
                return
            task = self._pending[caller_id] = asyncio.get_running_loop().create_task(self._learn(caller_id))
            task.add_done_callback(lambda _: self._pending.pop(caller_id, None))
        await asyncio.shield(task)

    async def _wait_first_router(self) -> None:
        """Wait briefly for a registration's answer, when one may bring the key (see the
        module's docstring); otherwise a credential that no known key verifies is refused."""
        if (self._routers and not self._registering) or self._num_router_waits >= self._max_router_waits:
            return
        if self._router_changed is None:
            self._router_changed = asyncio.Event()
        self._num_router_waits += 1
        try:
            await asyncio.wait_for(self._router_changed.wait(), self._router_wait_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._num_router_waits -= 1

    async def _learn(self, caller_id: str) -> None:
        found: Identity | None = None
        answered = False
        for address, lookup in list(self._sources.items()):
            try:
                found = await asyncio.wait_for(lookup(caller_id), self._lookup_timeout_s)
            except (asyncio.TimeoutError, ConnectionError) as exc:
                log.warning("key lookup of %r at router %s failed: %r", caller_id, address, exc)
                continue
            answered = True
            if found is not None:
                break
        if not answered and caller_id in self._peers:
            found = self._peers[caller_id][0]  # no registry answered: what we knew stands
        self._peers[caller_id] = (found, self._clock())
        self._peers.move_to_end(caller_id)
        while len(self._peers) > self._max_entries:
            self._peers.popitem(last=False)
