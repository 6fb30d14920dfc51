"""Offload: blocks the device pool evicts are copied to the tier below it on a thread of
their own, so the step that evicts them does not copy them.

Ordering rule: an evicted block's bytes are copied before anything writes into the block
again. The pool hands an evicted block out at once (to the request that needed it), but
nothing writes into it before the scheduler's step ends, and the step ends with
`fence()` (`KVCacheManager.offload_fence`): it waits for every copy queued so far. A copy
still queued at the fence's deadline is cancelled, never stored: a copy taken after the
block was written again would be another prefix's bytes under this one's key.

Bounded: at most `max_pending_blocks` blocks wait for their copy; past that, an eviction is
dropped (counted in the target tier's `dropped`), never queued without bound.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from pdserve.engine.block_pool import EvictedBlock
from pdserve.kvtransfer.blocks import gather_to_host
from pdserve.kvtransfer.tiers.stats import TierStats

log = logging.getLogger("pdserve.kvtransfer.tiers")

FENCE_TIMEOUT_S = 30.0

Target = Callable[[list[int], list[bytes | None], torch.Tensor], object]  # put(hashes, digests, blocks)


@dataclass(slots=True)
class _Job:
    blocks: list[EvictedBlock]
    target: Target
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Offloader:
    def __init__(self, target: Target, stats: TierStats, max_pending_blocks: int = 1024) -> None:
        self._target = target
        self._stats = stats  # the target tier's: what it could not take is counted there
        self.max_pending_blocks = max_pending_blocks
        self._kv_caches: list[torch.Tensor] = []
        self._cond = threading.Condition()
        self._jobs: deque[_Job] = deque()  # queued or copying, oldest first
        self._pending_blocks = 0
        self._closed = False
        self.num_offloaded = 0
        self._thread = threading.Thread(target=self._run, name="pdkv-offload", daemon=True)
        self._thread.start()

    def attach(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self._kv_caches = list(kv_caches)

    def evicted(self, blocks: list[EvictedBlock]) -> None:
        """`BlockPool.on_evict` (engine thread): queue their copy; dropped past the bound."""
        self.copy(blocks, self._target)

    def copy(self, blocks: list[EvictedBlock], target: Target) -> None:
        """Queue a copy of these blocks for `target` (engine thread). A block published but
        not evicted is written again only after its eviction, which queues behind it."""
        with self._cond:
            if self._closed or self._pending_blocks + len(blocks) > self.max_pending_blocks:
                with self._stats.lock:
                    self._stats.dropped += len(blocks)
                return
            self._pending_blocks += len(blocks)
            self._jobs.append(_Job(list(blocks), target))
            self._cond.notify_all()

    def fence(self, timeout_s: float = FENCE_TIMEOUT_S) -> None:
        """Wait until every eviction queued so far is copied (see the ordering rule)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            waiting = list(self._jobs)
        for job in waiting:
            if not job.done.wait(max(0.0, deadline - time.monotonic())):
                with self._cond:
                    for late in self._jobs:
                        late.cancelled = True
                log.error("kv offload: copies not done within %.0f s; cancelled, not stored", timeout_s)
                return

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs[0]
            self._copy(job)

    def _copy(self, job: _Job) -> None:
        """Copy one job's blocks and hand them to its target; only then is the job done, so
        that a flush (the fence, then the target's own flush) never misses a copy on its way."""
        data = None
        try:
            if not job.cancelled:
                data = gather_to_host(self._kv_caches, [b.block_id for b in job.blocks])
        except Exception as exc:  # noqa: BLE001 - an offload never fails the engine
            log.error("kv offload: copy failed: %r", exc)
        with self._cond:
            keep = data is not None and not job.cancelled
            self._jobs.popleft()
            self._pending_blocks -= len(job.blocks)
        try:
            if not keep:
                with self._stats.lock:
                    self._stats.dropped += len(job.blocks)
                return
            job.target([b.block_hash for b in job.blocks], [b.digest for b in job.blocks], data)
            self.num_offloaded += len(job.blocks)
        except Exception as exc:  # noqa: BLE001
            log.error("kv offload: storing failed: %r", exc)
        finally:
            job.done.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop after the copies queued (up to `timeout_s`). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
