"""The scheduler half's lookups through the tiers: after the device pool's own prefix hit,
the host tier's run of blocks, then the prefix store's (`StoreLoads`) from where the host
tier's run ends. Every hit is verified before it is offered (the host tier: the block's
prefix digest; a store: MAC, format and digest) and becomes one `LoadSpec` that the worker
half scatters into the allocated blocks before the forward. What each tier gave a request
is kept for its usage (`tokens_by_tier`)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from pdserve.engine.connector import ConnectorRequest, KVCacheLayout
from pdserve.kvtransfer.connector.metadata import LoadSpec
from pdserve.kvtransfer.connector.prefix_store import NoStoreLoads, StoreLoads
from pdserve.kvtransfer.tiers.host import HostTier
from pdserve.kvtransfer.tiers.stats import TierStats


@dataclass(slots=True)
class _HostLookup:
    start_block: int
    payloads: tuple[memoryview, ...]
    seconds: float = 0.0  # finding, verifying and copying them


def _as_bytes(block: torch.Tensor) -> memoryview:
    return memoryview(block.contiguous().view(torch.uint8).reshape(-1).numpy())


class TieredLoads:
    """`StoreLoads`' interface, with the host tier in front of the store."""

    def __init__(self, host: HostTier | None, lower: StoreLoads | NoStoreLoads, layout: KVCacheLayout,
                 lower_stats: TierStats | None = None) -> None:
        self.host = host
        self.lower = lower
        self.layout = layout
        self.lower_stats = lower_stats
        self._host_lookups: dict[str, _HostLookup] = {}
        self._by_tier: dict[str, dict[str, int]] = {}
        self._lower_seconds: dict[str, float] = {}
        self.num_host_blocks = 0

    @property
    def saves(self) -> bool:
        return self.lower.saves

    @property
    def num_matched_blocks(self) -> int:
        return self.num_host_blocks + self.lower.num_matched_blocks

    def match(self, request: ConnectorRequest, start: int) -> int:
        rid, bs = request.request_id, self.layout.block_size
        cached = self._host_lookups.get(rid)
        if cached is None or cached.start_block != start:
            began = time.perf_counter()
            cached = _HostLookup(start, self._match_host(request, start))
            cached.seconds = time.perf_counter() - began
            self._host_lookups[rid] = cached
        n_host = len(cached.payloads)
        began = time.perf_counter()
        n_lower = self.lower.match(request, start + n_host)
        self._lower_seconds.setdefault(rid, time.perf_counter() - began)  # a retry reuses the fetch
        self._by_tier[rid] = {k: v for k, v in (("host", n_host * bs),
                                                (getattr(getattr(self.lower, "store", None), "name", "store"),
                                                 n_lower * bs)) if v}
        return n_host + n_lower

    def _match_host(self, request: ConnectorRequest, start: int) -> tuple[memoryview, ...]:
        if self.host is None:
            return ()
        max_blocks = (len(request.prompt_token_ids) - 1) // self.layout.block_size
        keys = request.block_hashes[start:max_blocks]
        if not keys:
            return ()
        digests = request.block_digests[start:max_blocks]
        blocks = self.host.match(keys, digests if len(digests) == len(keys) else None)
        return tuple(_as_bytes(b) for b in blocks)

    def load_spec(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> LoadSpec | None:
        host = self._host_lookups.pop(request_id, None)
        bs = self.layout.block_size
        n_host = min(len(host.payloads), max(0, num_external_tokens) // bs) if host else 0
        lower = self.lower.load_spec(request_id, block_ids, num_external_tokens - n_host * bs)
        if self.host is not None and host is not None:
            self.host.stats.onboarded(n_host, host.seconds)
            self.num_host_blocks += n_host
        if self.lower_stats is not None:
            self.lower_stats.onboarded(len(lower.payloads) if lower else 0, self._lower_seconds.pop(request_id, 0.0))
        if not n_host:
            return lower
        dst = tuple(block_ids[host.start_block:host.start_block + n_host])
        payloads = host.payloads[:n_host]
        if lower is not None:
            dst, payloads = dst + lower.block_ids, payloads + lower.payloads
        return LoadSpec(request_id, dst, payloads)

    def tokens_by_tier(self, request_id: str) -> dict[str, int]:
        """Prompt tokens each tier below the pool gave `request_id` at its admission."""
        return dict(self._by_tier.get(request_id, {}))

    def forget(self, request_id: str) -> None:
        self._host_lookups.pop(request_id, None)
        self._by_tier.pop(request_id, None)
        self._lower_seconds.pop(request_id, None)
        self.lower.forget(request_id)
