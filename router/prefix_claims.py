"""Prefix claims: which of the blocks a worker says it caches the router believes.

Threat: a worker (any process holding a worker's enrollment, or a compromised worker)
reporting block hashes of prefixes it does not hold, say a popular system prompt's, wins
prefix-aware routing for every prompt that starts with them, and so reads those prompts.

Rule: a reported hash counts only if the router itself sent that worker a prompt holding
the block (`RoutedPrefixes.note`, at routing); everything else in a report is dropped
(`vouched`). A worker can then claim only what it was given, at most what it still holds
or once held. Memory is bounded per worker (the oldest routed hashes are forgotten first).
With `--check-prefix-claims`, `WorkerRegistry` hands each worker's `KVIndex` its `voucher`:
the blocks of stored events and of snapshots pass through it before they count. Off, claims
are taken as sent, and a router restarted reroutes a returning session to its holder at once
from the worker's snapshot; on, that affinity returns only as prompts are routed again.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

MAX_ROUTED_PER_WORKER = 1 << 16  # routed block hashes remembered per worker (newest kept)


class RoutedPrefixes:
    """Per worker, the block hashes of the prompts the router sent it (newest last)."""

    def __init__(self, max_per_worker: int) -> None:
        self._max = max_per_worker
        self._sent: dict[str, OrderedDict[int, None]] = {}

    def note(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """A prompt holding `block_hashes` was sent to `worker_id`."""
        sent = self._sent.setdefault(worker_id, OrderedDict())
        for block_hash in block_hashes:
            sent[int(block_hash)] = None
            sent.move_to_end(int(block_hash))
        while len(sent) > self._max:
            sent.popitem(last=False)

    def vouched(self, worker_id: str, claimed: Iterable[int]) -> list[int]:
        """The hashes of `claimed` the router sent `worker_id`, in their order; the rest are
        dropped (see the module docstring)."""
        sent = self._sent.get(worker_id)
        if not sent:
            return []
        return [h for h in map(int, claimed) if h in sent]

    def voucher(self, worker_id: str) -> Callable[[Iterable[int]], list[int]]:
        """`vouched` for one worker."""
        return functools.partial(self.vouched, worker_id)

    def forget(self, worker_id: str) -> None:
        self._sent.pop(worker_id, None)
