"""Which workers exist, whether they are alive, how loaded they are and what they cache
(each record's `kv`: an index its KV events keep, router.kv_index).

A worker is *routable* when its last heartbeat is younger than the timeout, no RPC to it
has failed since (a failed RPC marks it suspect; its next heartbeat clears that) and it has
not announced that it is draining (it is leaving: its open streams go on, no new work comes).
Workers silent for three timeouts are forgotten: their next heartbeat is answered
NOT_FOUND and they register again.

A registration binds the worker id to its lease and, with a cluster secret, to the public
key its calls are signed with (the rule: `security.registration`; `RegistryKeys`: the
router's directory of workers' keys).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from pdserve.common.errors import AlreadyExistsError, AuthError
from pdserve.router.config import Role
from pdserve.router.kv_index import KVIndex
from pdserve.router.prefix_claims import MAX_ROUTED_PER_WORKER, RoutedPrefixes
from pdserve.security import registration
from pdserve.security.credentials import Identity

log = logging.getLogger("pdserve.router.worker_registry")

FORGET_AFTER_TIMEOUTS = 3
REFUSAL_PENALTY_S = 2.0  # a first refusal after reading a request: last choice this long
MAX_REFUSAL_PENALTY_S = 60.0
# A report arriving now may have been taken before a request routed this recently reached
# the worker: such requests keep counting beside it. Older ones are in the report (or done).
ROUTED_SETTLE_S = 0.5


@dataclass(frozen=True, slots=True)
class Worker:
    """A registered worker's static facts (from WorkerInfo)."""

    worker_id: str
    role: Role
    address: str  # gRPC "host:port"
    model_name: str
    compatibility_hash: int = 0  # 0: unknown (static workers)
    block_size: int = 16
    num_total_blocks: int = 0
    max_model_len: int = 0
    kv_backends: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KVBackendState:
    """One KV transfer backend as its worker last reported it."""

    name: str
    usable: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Load:
    """A worker's reported load (from WorkerLoad)."""

    num_queued: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_backends: tuple[KVBackendState, ...] = ()  # empty: not reported (every backend counts usable)
    counters: Any = None  # common_pb2.EngineCounters of the last report, when it had them
    queued_prompt_tokens: int = 0  # prompt tokens queued or running, not computed yet
    prefill_tokens_per_s: float = 0.0  # its recent prefill rate (0: not measured yet)
    num_decoding: int = 0  # running requests past their prompt
    draining: bool = False  # leaving: routed no new work, finishing its own
    lora_adapters: tuple = ()  # common_pb2.LoraAdapterState of each adapter it serves (loaded or loadable)


@dataclass(slots=True)
class WorkerRecord:
    """The registry's mutable view of one worker. Only the registry writes it."""

    worker: Worker
    load: Load
    last_seen: float
    kv: KVIndex = field(default_factory=KVIndex)
    suspect: bool = False
    # (when, prompt tokens for it to compute) of each request sent since the last report, or
    # within ROUTED_SETTLE_S before it
    routed_since_report: collections.deque = field(default_factory=collections.deque)
    num_streams: int = 0  # this router's Decode streams open to it now
    lease: bytes = b""  # what the worker must show to heartbeat, deregister or register again (b"": none asked)
    public_key: bytes = b""  # what verifies the worker's own call credentials (b"": none given)
    num_refusals: int = 0  # requests it refused after reading them, since it last finished one
    refused_until: float = 0.0  # routed to only when no other worker may be, until then

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    @property
    def num_routed_since_report(self) -> int:
        return len(self.routed_since_report)

    @property
    def num_routed_prompt_tokens(self) -> int:
        return sum(tokens for _, tokens in self.routed_since_report)

    def load_score(self) -> int:
        """Work queued or running, counting what this router sent since the last report; at
        least the streams this router has open to it (a report may predate their arrival)."""
        return max(self.load.num_queued + self.load.num_running + self.num_routed_since_report, self.num_streams)

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens ahead of a new one here: the last report's, plus what this router sent
        to compute since (a burst arrives faster than reports)."""
        return self.load.queued_prompt_tokens + self.num_routed_prompt_tokens

    def usable_backends(self) -> set[str]:
        """The KV backends this worker speaks that its last report calls usable."""
        unusable = {b.name for b in self.load.kv_backends if not b.usable}
        return {b for b in self.worker.kv_backends if b not in unusable}

    def num_matched_blocks(self, block_hashes: Sequence[int]) -> int:
        """Length of the run of `block_hashes`, from the first, this worker holds in any tier."""
        return len(self.kv.leading_tiers(block_hashes))


class WorkerRegistry:
    def __init__(self, worker_timeout_s: float, max_indexed_blocks: int = 1 << 20,
                 clock: Callable[[], float] = time.monotonic, check_claims: bool = False) -> None:
        """`max_indexed_blocks`: the most block hashes the index keeps per worker.
        `check_claims`: a worker's KV events count only for blocks this router sent it
        (`prefix_claims`; affinity then starts afresh after a router restart)."""
        self._timeout_s = worker_timeout_s
        self._max_indexed_blocks = max_indexed_blocks
        self._clock = clock
        self._records: dict[str, WorkerRecord] = {}
        self.routed = RoutedPrefixes(min(max_indexed_blocks, MAX_ROUTED_PER_WORKER))  # checks KV claims
        self._check_claims = check_claims

    def register(self, worker: Worker, load: Load, *, lease: bytes = b"", leased: bool = False, public_key: bytes = b"") -> bytes:
        """Add or replace `worker`; an entry with the same address (a restart under a new
        id) is replaced too. ALREADY_EXISTS while the id is alive, unless `lease` is that
        registration's and `public_key` its key: a second process cannot take over a live
        worker's id (and its traffic). With `leased`, returns the new registration's lease,
        which heartbeats and deregistration must show."""
        self.check_free(worker, lease, public_key)
        for other in [r for r in self._records.values() if r.worker.address == worker.address]:
            if other.worker_id != worker.worker_id:
                log.info("worker %s replaces %s at %s", worker.worker_id, other.worker_id, worker.address)
                del self._records[other.worker_id]
        new_lease = registration.new_lease() if leased else b""
        self._records[worker.worker_id] = WorkerRecord(worker, load, self._clock(), lease=new_lease,
                                                       public_key=public_key,
                                                       kv=KVIndex(max_blocks=self._max_indexed_blocks,
                                                                  vouch=self._voucher(worker.worker_id)))
        log.info("registered %s worker %s at %s (model %s)", worker.role.value, worker.worker_id,
                 worker.address, worker.model_name)
        return new_lease

    def _voucher(self, worker_id: str):
        return self.routed.voucher(worker_id) if self._check_claims else None

    def check_free(self, worker: Worker, lease: bytes = b"", public_key: bytes = b"") -> None:
        """ALREADY_EXISTS unless `worker` may register now (see `register`). A live leased
        registration keeps its address too: a new id there would replace it."""
        for other in self._records.values():
            if (other.worker.address == worker.address and other.worker_id != worker.worker_id
                    and other.lease and self.is_alive(other)):
                raise AlreadyExistsError(f"address {worker.address} is live worker {other.worker_id!r}'s",
                                         param="grpc_address")
        current = self._records.get(worker.worker_id)
        if current is None or not self.is_alive(current):
            return
        registration.check_takeover(worker.worker_id, worker.address, lease, public_key,
                                    live_address=current.worker.address, live_lease=current.lease,
                                    live_key=current.public_key)

    def heartbeat(self, worker_id: str, load: Load, *, lease: bytes | None = None) -> bool:
        """Record a load report. False when the worker is unknown (it must register);
        AuthError when its registration has a lease and `lease` is not it (None: the
        router's own report, from polling a static worker)."""
        self.forget_silent()
        record = self._records.get(worker_id)
        if record is None:
            return False
        _check_lease(record, lease)
        if record.suspect:
            log.info("worker %s is reachable again", worker_id)
        if load.draining and not record.load.draining:
            log.info("worker %s is draining: no new work goes to it", worker_id)
        record.load, record.last_seen, record.suspect = load, self._clock(), False
        routed, settled = record.routed_since_report, record.last_seen - ROUTED_SETTLE_S
        while routed and routed[0][0] < settled:
            routed.popleft()
        return True

    def deregister(self, worker_id: str, *, lease: bytes | None = None) -> bool:
        """Remove a worker: AuthError when its registration has a lease and `lease` is not
        it (None: the router's own decision)."""
        record = self._records.get(worker_id)
        if record is None:
            return False
        _check_lease(record, lease)
        del self._records[worker_id]
        self.routed.forget(worker_id)
        log.info("deregistered worker %s", worker_id)
        return True

    def check_lease(self, worker_id: str, lease: bytes) -> bool:
        """False when the worker is unknown; AuthError unless `lease` is its registration's."""
        record = self._records.get(worker_id)
        if record is None:
            return False
        _check_lease(record, lease)
        return True

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._records.get(worker_id)

    def mark_suspect(self, worker_id: str, why: str) -> None:
        record = self._records.get(worker_id)
        if record is not None and not record.suspect:
            record.suspect = True
            log.warning("worker %s marked suspect: %s", worker_id, why)

    def note_routed(self, worker_id: str, prompt_tokens: int = 0, block_hashes: Sequence[int] = ()) -> None:
        """A request was sent to the worker (`prompt_tokens` of it for the worker to compute):
        it counts in its load until the next report. What it caches, its KV events say, for
        the blocks it was sent (`block_hashes`: `prefix_claims`)."""
        record = self._records.get(worker_id)
        if record is not None:
            if self._check_claims:
                self.routed.note(worker_id, block_hashes)
            record.routed_since_report.append((self._clock(), prompt_tokens))

    def note_adapter(self, worker_id: str, state) -> None:
        """A LoRA adapter the router just had the worker load (its next report confirms it)."""
        record = self._records.get(worker_id)
        if record is not None:
            kept = tuple(a for a in record.load.lora_adapters if a.name != state.name)
            record.load = dataclasses.replace(record.load, lora_adapters=(*kept, state))

    def note_adapter_gone(self, worker_id: str, name: str) -> None:
        """A LoRA adapter the router just had the worker unload."""
        record = self._records.get(worker_id)
        if record is not None:
            record.load = dataclasses.replace(
                record.load, lora_adapters=tuple(a for a in record.load.lora_adapters if a.name != name))

    def note_refusal(self, worker_id: str) -> None:
        """The worker refused a request after reading it (RESOURCE_EXHAUSTED): it counts
        against it. It is routed to only when no other worker may be for a while that
        doubles with each refusal (REFUSAL_PENALTY_S up to MAX_REFUSAL_PENALTY_S), so a
        worker cannot read prompts and send them elsewhere unseen."""
        record = self._records.get(worker_id)
        if record is not None:
            record.num_refusals += 1
            penalty = min(MAX_REFUSAL_PENALTY_S, REFUSAL_PENALTY_S * 2 ** (record.num_refusals - 1))
            record.refused_until = self._clock() + penalty
            log.info("worker %s refused a request (%d in a row): last choice for %.1f s", worker_id,
                     record.num_refusals, penalty)

    def note_finished(self, worker_id: str) -> None:
        """The worker finished a request: its refusals are forgiven."""
        record = self._records.get(worker_id)
        if record is not None:
            record.num_refusals = 0

    def note_stream(self, worker_id: str, delta: int) -> None:
        """A Decode stream to the worker opened (+1) or ended (-1)."""
        record = self._records.get(worker_id)
        if record is not None:
            record.num_streams = max(0, record.num_streams + delta)

    def is_alive(self, record: WorkerRecord) -> bool:
        return self._clock() - record.last_seen <= self._timeout_s

    def routable(self, role: Role, model_name: str) -> list[WorkerRecord]:
        """Alive, non-suspect, non-draining workers of `role` serving `model_name`, sorted by id;
        those in a refusal's penalty (`note_refusal`) only when there is no other."""
        found = sorted((r for r in self._records.values()
                        if r.worker.role is role and r.worker.model_name == model_name
                        and not r.suspect and not r.load.draining and self.is_alive(r)),
                       key=lambda r: r.worker_id)
        now = self._clock()
        return [r for r in found if r.refused_until <= now] or found

    def alive(self, role: Role | None = None) -> list[WorkerRecord]:
        return sorted((r for r in self._records.values()
                       if (role is None or r.worker.role is role) and self.is_alive(r)),
                      key=lambda r: r.worker_id)

    def records(self) -> list[WorkerRecord]:
        return sorted(self._records.values(), key=lambda r: r.worker_id)

    def forget_silent(self) -> None:
        horizon = self._clock() - FORGET_AFTER_TIMEOUTS * self._timeout_s
        for worker_id in [w for w, r in self._records.items() if r.last_seen < horizon]:
            log.warning("forgetting silent worker %s", worker_id)
            del self._records[worker_id]
            self.routed.forget(worker_id)


def _check_lease(record: WorkerRecord, lease: bytes | None) -> None:
    try:
        registration.check_lease(record.worker_id, record.lease, lease)
    except AuthError:
        log.warning("refused a call for worker %s without its registration's lease", record.worker_id)
        raise


class RegistryKeys:
    """The router's `KeyDirectory`: a worker id's key is the one its registration bound
    (kept until the registration is forgotten, so that a worker past its timeout can still
    heartbeat). There is nothing to refresh: a worker's key arrives with its Register."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self._registry = registry

    def identities(self, caller_id: str) -> Sequence[Identity]:
        record = self._registry.get(caller_id)
        if record is None or not record.public_key:
            return ()
        return (Identity(caller_id, record.worker.role.value, record.public_key),)

    async def refresh(self, caller_id: str) -> None:
        return None
