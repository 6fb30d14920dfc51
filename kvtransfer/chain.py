"""The fallback chain: try each backend in order until one carries the blocks.

Per transfer, for each backend of the order (the receiver's, filtered to what this side has):

* skipped, with a reason, if this side does not have it, the receiver gave no endpoint for
  it, it is unhealthy and its cool-down is not over, or the transfer's deadline has passed;
* point-to-point (ucx, nccl): `send` straight into the receiver's blocks, under a per-step
  deadline. Success = the receiver accepted and committed the message;
* store (redis, disk): `put` every block (full blocks under their content hash, a partial
  block under a short-lived key). Success = all stored; the verdict carries the keys and the
  receiver fetches them through its own sink checks (`receive.land_from_store`);
* recompute: the chain stops; the KV did not go (FAILED), and the receiver's failure
  policy decides what the request does (`verdict.decide`).

Every attempt that did not carry the transfer becomes a `Fallback` in the verdict.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from pdserve.engine.connector import BackendState
from pdserve.kvtransfer.base import BlockMessage, BlockStore, KVTransport
from pdserve.kvtransfer.health import BackendHealth, HealthPolicy
from pdserve.kvtransfer.verdict import RECOMPUTE, Fallback, Landing, TransferVerdict

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SendJob:
    """One transfer to carry: `message` (destination ids in its index) and, for stores, the
    key of each of its blocks."""

    transfer_id: bytes
    message: BlockMessage
    store_keys: tuple[int, ...]
    endpoints: Mapping[str, str] = field(default_factory=dict)  # backend -> receiver endpoint
    order: tuple[str, ...] = ()  # empty: the chain's own order
    deadline: float = float("inf")  # time.monotonic() instant for the whole transfer
    digests: tuple[bytes, ...] = ()  # the prefix digest of each leading full block, stored with it

    @property
    def num_blocks(self) -> int:
        return len(self.store_keys)


class FallbackChain:
    """Thread-safe (health is locked; backends are thread-safe by contract)."""

    def __init__(self, order: Sequence[str], *, transports: Mapping[str, KVTransport] = {},
                 stores: Mapping[str, BlockStore] = {}, unavailable: Mapping[str, str] = {},
                 step_timeout_s: float = 10.0, health_policy: HealthPolicy = HealthPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock` times the transports' health cool-downs (stores bring their own health)."""
        self.order = tuple(order)
        self.transports = dict(transports)
        self.stores = dict(stores)
        self.unavailable = dict(unavailable)  # backend -> why it could not be opened here
        self.step_timeout_s = step_timeout_s
        self.health = {name: BackendHealth(name, health_policy, clock) for name in self.transports}
        self.health.update({name: store.health for name, store in self.stores.items()})

    def send(self, job: SendJob, broken: Fallback | None = None) -> TransferVerdict:
        """Carry `job` through the first backend that can. `broken`: a stream through that
        backend broke off (`send_part`); the chain goes on past it."""
        start = time.monotonic()
        fallbacks: list[Fallback] = [broken] if broken else []
        order = job.order or self.order
        for name in order:
            if name == RECOMPUTE:
                break
            if broken and name == broken.backend:
                continue
            now = time.monotonic()
            skip = self._skip_reason(name, job.endpoints, job.deadline, now)
            if skip:
                fallbacks.append(Fallback(name, skip))
                continue
            step_deadline = min(job.deadline, now + self.step_timeout_s)
            error = self._attempt(name, job, step_deadline)
            if error is None:
                return self._verdict(job, start, Landing.LANDED, name, fallbacks)
            fallbacks.append(Fallback(name, error, time.monotonic() - now))
            log.warning("transfer %s: %s failed: %s", job.transfer_id.hex()[:12], name, error)
        return self._verdict(job, start, Landing.MISSING, "", fallbacks)

    def stream_backend(self, endpoints: Mapping[str, str], order: Sequence[str] = ()) -> str | None:
        """The backend a layer-wise stream may go through now: the first of `order` that
        could carry a transfer, when it is point-to-point (stores keep whole blocks)."""
        now = time.monotonic()
        for name in order or self.order:
            if name == RECOMPUTE:
                return None
            if not self._skip_reason(name, endpoints, float("inf"), now):
                return name if name in self.transports else None
        return None

    def send_part(self, name: str, endpoint: str, message: BlockMessage, deadline: float) -> None:
        """One message through transport `name` (a whole transfer, or one message of a
        stream) under the step deadline, its outcome kept in the backend's health. Raises
        like `KVTransport.send`."""
        health = self.health[name]
        try:
            self.transports[name].send(endpoint, message, min(deadline, time.monotonic() + self.step_timeout_s))
        except TimeoutError as exc:
            health.record_failure(f"timed out: {exc}")
            raise
        except Exception as exc:  # noqa: BLE001 - any failure counts against its health; re-raised
            health.record_failure(f"{exc.__class__.__name__}: {exc}")
            raise
        health.record_success()

    def states(self) -> list[BackendState]:
        """Each backend of the chain as it stands now ("recompute" is not a backend)."""
        out = []
        for name in self.order:
            if name == RECOMPUTE:
                continue
            if name not in self.transports and name not in self.stores:
                out.append(BackendState(name, False, self.unavailable.get(name, "not opened here")))
            elif self.health[name].can_try():
                out.append(BackendState(name, True))
            else:
                out.append(BackendState(name, False, self.health[name].skip_reason()))
        return out

    def unusable(self, endpoints: Mapping[str, str], order: Sequence[str] = ()) -> list[Fallback]:
        """[] when some backend of `order` (default: the chain's) could carry a transfer to
        `endpoints` now; else why each one cannot. Lets a sender refuse a transfer before
        computing anything for it."""
        skipped = []
        for name in order or self.order:
            if name == RECOMPUTE:
                break
            skip = self._skip_reason(name, endpoints, float("inf"), time.monotonic())
            if not skip:
                return []
            skipped.append(Fallback(name, skip))
        return skipped or [Fallback(RECOMPUTE, "no KV backend to try")]

    def _skip_reason(self, name: str, endpoints: Mapping[str, str], deadline: float, now: float) -> str:
        if now >= deadline:
            return "the transfer's deadline passed"
        if name not in self.transports and name not in self.stores:
            return self.unavailable.get(name, "not configured on the sender")
        if name in self.transports and name not in endpoints:
            return "the receiver has no endpoint for it"
        health = self.health[name]
        if not health.can_try():
            return health.skip_reason()
        return ""

    def _attempt(self, name: str, job: SendJob, deadline: float) -> str | None:
        """Run one step. None on success, else why it failed."""
        if name in self.transports:
            try:
                self.send_part(name, job.endpoints[name], job.message, deadline)
            except TimeoutError as exc:
                return f"timed out after {self.step_timeout_s:g}s step deadline: {exc}"
            except Exception as exc:  # a backend's bug must not end the chain
                return f"{exc.__class__.__name__}: {exc}"
            return None
        store = self.stores[name]
        stored = store.put(job.store_keys, job.message, job.digests)  # records its own health
        if stored == job.num_blocks:
            return None
        detail = store.health.last_error or "backend refused"
        return f"stored {stored} of {job.num_blocks} blocks ({detail})"

    def _verdict(self, job: SendJob, start: float, landing: Landing, backend: str,
                 fallbacks: list[Fallback]) -> TransferVerdict:
        moved = landing == Landing.LANDED
        return TransferVerdict(
            transfer_id=job.transfer_id.hex(), landing=landing, backend=backend,
            num_blocks=job.num_blocks if moved else 0,
            num_bytes=job.message.nbytes if moved else 0,
            duration_s=time.monotonic() - start, fallbacks=tuple(fallbacks),
            fetch_keys=job.store_keys if moved and backend in self.stores else ())

    def close(self) -> None:
        """Close every backend. Idempotent."""
        for backend in (*self.transports.values(), *self.stores.values()):
            try:
                backend.close()
            except Exception as exc:  # closing must reach every backend
                log.warning("closing %s: %s", backend.name, exc)
