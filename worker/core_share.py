"""Engines on one machine sharing its cores (`--core-share PATH`, which `pdserve up` sets).

The share is a small file that every member maps: one byte a slot, 1 while that member's
engine is computing, 0 while it is idle (nothing to step, or every request waits on
another service). An engine takes its burst thread count while every other member is
idle and its base count otherwise; while it runs above its base count it checks between
layers, so a peer that starts computing gets its core back within a layer.

A member holds its slot with a lock on that byte (fcntl), which the kernel drops when the
process dies; a joining member clears every slot nobody holds, so a killed worker's last
state does not hold the others to their base count after `up` restarts it.
On a cluster each worker has its own cores: no share, every step takes `--num-threads`.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
from pathlib import Path

log = logging.getLogger("pdserve.worker.core_share")

NUM_SLOTS = 64  # members one share can hold


class CoreShareFullError(RuntimeError):
    """Every slot of the share is held."""


class CoreShare:
    """One member's view of the share: its `ThreadPolicy` (pdserve.engine.step_threads)."""

    def __init__(self, path: str | os.PathLike, base: int, burst: int) -> None:
        if base < 1 or burst < base:
            raise ValueError(f"need 1 <= base ({base}) <= burst ({burst})")
        self.base, self.burst = base, burst
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(self._fd, max(os.fstat(self._fd).st_size, NUM_SLOTS))
            self._map = mmap.mmap(self._fd, NUM_SLOTS)
            self.slot = self._claim()
        except BaseException:
            os.close(self._fd)
            raise
        self._computing = False

    def _claim(self) -> int:
        """Lock the first free slot; clear every other free one (a dead member's state)."""
        mine = None
        for i in range(NUM_SLOTS):
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, i)
            except OSError:
                continue  # another member's
            self._map[i] = 0
            if mine is None:
                mine = i
            else:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, i)
        if mine is None:
            raise CoreShareFullError(f"every one of the {NUM_SLOTS} slots of {self.path} is held")
        return mine

    def others_idle(self) -> bool:
        """No other member is computing (read without a lock: a hint, stale by a step at most)."""
        states = self._map[:NUM_SLOTS]
        return states.count(1) == (1 if self._computing else 0)

    # -- ThreadPolicy ------------------------------------------------------------------------
    def step_threads(self, forward: bool) -> int:
        if forward != self._computing:
            self._map[self.slot] = 1 if forward else 0
            self._computing = forward
        return self.burst if forward and self.others_idle() else self.base

    def layer_threads(self) -> int | None:
        return None if self.others_idle() else self.base

    def close(self) -> None:
        if self._fd < 0:
            return
        self._map[self.slot] = 0
        self._map.close()
        os.close(self._fd)  # drops the slot's lock
        self._fd = -1
