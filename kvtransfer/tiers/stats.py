"""What a tier says about itself in /metrics: a snapshot per tier, the same fields for all."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(slots=True)
class TierStats:
    """Counters of one tier since start (`blocks` and `bytes`: what it holds now, where it
    knows; a shared store's own total is unknown to one worker: there, what this worker
    wrote). Updated under `lock` by the tier's threads; read with `snapshot`."""

    tier: str
    capacity_bytes: int = 0  # 0: bounded elsewhere (a store's own budget or TTL)
    blocks: int = 0
    bytes: int = 0
    hits: int = 0  # blocks onboarded from it
    misses: int = 0  # lookups that found nothing there
    evictions: int = 0  # blocks it let go to stay within its bound
    corrupt: int = 0  # records refused (MAC, format, truncated, digest): misses, never served
    dropped: int = 0  # blocks not taken in (queue full, tier off)
    onboard_seconds: float = 0.0  # time spent finding, verifying and copying its hits
    onboards: int = 0  # lookups that found something there
    enabled: bool = True
    reason: str = ""  # why it is off
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def snapshot(self) -> "TierStats":
        with self.lock:
            return TierStats(self.tier, self.capacity_bytes, self.blocks, self.bytes, self.hits, self.misses,
                             self.evictions, self.corrupt, self.dropped, self.onboard_seconds, self.onboards,
                             self.enabled, self.reason)

    def onboarded(self, num_blocks: int, seconds: float) -> None:
        with self.lock:
            if num_blocks:
                self.hits += num_blocks
                self.onboards += 1
                self.onboard_seconds += seconds
            else:
                self.misses += 1
