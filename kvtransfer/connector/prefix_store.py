"""The connector's prefix-store room: a persistent prefix cache in a Redis or disk store.

Two sides, on two callers:

* `StoreLoads`, the scheduler half's: which full prompt blocks beyond the local prefix hit the
  store holds. They are fetched and verified at lookup, before allocation (MAC, format, and
  the block's prefix digest: a record under a colliding key holds another prefix's KV and is
  a miss), so a block that
  vanishes between the lookup and the load (pruned by another process, corrupt) can never
  leave the engine believing in tokens it does not have.
* `StoreSaves`, the worker half's: scatters those payloads into the allocated blocks before
  the forward; after it, gathers each request's newly completed full prompt blocks (at once:
  the blocks may be reused after the step) and stores them on its own thread.

Without a prefix store the connector holds `NoStoreLoads` / `NoStoreSaves`.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from pdserve.common.errors import InvalidRequestError
from pdserve.engine.connector import ConnectorRequest, KVCacheLayout, LayerSaveContext
from pdserve.kernels.omp import one_intra_op_thread
from pdserve.kvtransfer.base import BlockStore
from pdserve.kvtransfer.blocks import buffer_from_bytes, gather_to_host, scatter_from_host
from pdserve.kvtransfer.codec import encode_message, new_transfer_id
from pdserve.kvtransfer.connector.background import Background
from pdserve.kvtransfer.connector.metadata import LoadSpec, SaveSpec
from pdserve.kvtransfer.sink import limits_for

log = logging.getLogger("pdserve.kvtransfer.connector")


@dataclass(slots=True)
class _Lookup:
    start_block: int
    payloads: tuple[memoryview, ...]


class StoreLoads:
    """Scheduler side: store hits, fetched and verified, and the loads they become."""

    saves = True  # requests' completed blocks go to the store too

    def __init__(self, store: BlockStore, layout: KVCacheLayout) -> None:
        self.store = store
        self.layout = layout
        self._limits = limits_for(layout)
        self._lookups: dict[str, _Lookup] = {}  # fetched hits waiting for allocation
        self.num_matched_blocks = 0  # blocks offered to the engine, all requests

    def match(self, request: ConnectorRequest, start: int) -> int:
        """Full blocks from `start` on that the store holds, fetched and verified now. At
        least one prompt token is always left to compute (its logits give the next token)."""
        cached = self._lookups.get(request.request_id)
        if cached is not None and cached.start_block == start:
            return len(cached.payloads)
        max_blocks = (len(request.prompt_token_ids) - 1) // self.layout.block_size
        keys = request.block_hashes[start:max_blocks]
        if not keys:
            return 0
        n = self.store.count_prefix_hits(keys, self._limits.compat_hash)
        digests = request.block_digests[start:start + n]
        payloads: list[memoryview] = []
        for payload in self.store.get(keys[:n], self._limits, digests if len(digests) == n else None) if n else ():
            if payload is None:  # pruned or corrupt since counted: keep the prefix
                break
            payloads.append(payload)
        self._lookups[request.request_id] = _Lookup(start, tuple(payloads))  # retries reuse it
        self.num_matched_blocks += len(payloads)
        log.info("prefix cache (%s): request %s matched %d of %d blocks beyond %d local",
                 self.store.name, request.request_id, len(payloads), len(keys), start)
        return len(payloads)

    def load_spec(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> LoadSpec | None:
        """The load of what `match` offered into the allocated `block_ids` (all of the
        request's blocks, in order, local prefix hit first)."""
        lookup = self._lookups.pop(request_id, None)
        if lookup is None or num_external_tokens <= 0 or not lookup.payloads:
            return None
        num = min(num_external_tokens // self.layout.block_size, len(lookup.payloads))
        dst = tuple(block_ids[lookup.start_block:lookup.start_block + num])
        if len(dst) != num:
            raise InvalidRequestError(f"request {request_id}: {len(block_ids)} blocks "
                                      f"allocated, loads need {lookup.start_block + num}")
        return LoadSpec(request_id, dst, lookup.payloads[:num])

    def forget(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)


class NoStoreLoads:
    """No prefix store: nothing matches, nothing is saved."""

    saves = False
    num_matched_blocks = 0

    def match(self, request: ConnectorRequest, start: int) -> int:
        return 0

    def load_spec(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> LoadSpec | None:
        return None

    def forget(self, request_id: str) -> None:
        pass


@dataclass(slots=True)
class _SaveState:
    block_hashes: tuple[int, ...]
    next_block: int
    block_digests: tuple[bytes, ...] = ()


class StoreSaves:
    """Worker side: loads scattered before the forward, completed blocks stored after it.
    Engine thread, plus one thread of its own for the store writes."""

    def __init__(self, store: BlockStore, layout: KVCacheLayout) -> None:
        self.store = store
        self.layout = layout
        self._limits = limits_for(layout)
        self._kv_caches: list[torch.Tensor] = []
        self._saves: dict[str, _SaveState] = {}
        self._background = Background(ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdkv-store",
                                                         initializer=one_intra_op_thread))

    def attach(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self._kv_caches = list(kv_caches)

    def load(self, loads: Sequence[LoadSpec]) -> None:
        scatter_loads(loads, self._kv_caches)

    def track(self, spec: SaveSpec) -> None:
        self._saves[spec.request_id] = _SaveState(spec.block_hashes, spec.first_block, spec.block_digests)

    def forget(self, request_id: str) -> None:
        self._saves.pop(request_id, None)

    def save_completed(self, context: LayerSaveContext) -> None:
        """Gather the full prompt blocks this step completed; store them in the background."""
        for rid, state in self._saves.items():
            block_ids = context.block_ids_by_request.get(rid)
            if block_ids is None or self._background.closed:
                continue
            num_full = min(context.num_computed_by_request.get(rid, 0) // self.layout.block_size,
                           len(state.block_hashes), len(block_ids))
            if num_full <= state.next_block:
                continue
            first, state.next_block = state.next_block, num_full
            blocks = gather_to_host(self._kv_caches, block_ids[first:num_full])
            self._background.submit(self._store_blocks, state.block_hashes[first:num_full],
                                    state.block_digests[first:num_full], blocks)

    def _store_blocks(self, keys: tuple[int, ...], digests: tuple[bytes, ...], blocks: torch.Tensor) -> None:
        message = encode_message(self._limits, new_transfer_id(), [0] * len(keys), keys, blocks)
        stored = self.store.put(keys, message, digests)
        log.debug("prefix cache (%s): stored %d of %d blocks", self.store.name, stored, len(keys))

    def flush(self, timeout_s: float) -> bool:
        return self._background.flush(timeout_s)

    def close(self, timeout_s: float) -> None:
        self._background.close(timeout_s)


def scatter_loads(loads: Sequence[LoadSpec], kv_caches: Sequence[torch.Tensor]) -> None:
    """Write verified payloads (from any tier) into their allocated blocks."""
    for spec in loads:
        payload = b"".join(spec.payloads)
        buffer = buffer_from_bytes(memoryview(payload), len(spec.block_ids), kv_caches)
        scatter_from_host(buffer, kv_caches, spec.block_ids)


class NoStoreSaves:
    """No prefix store: nothing saved; loads (the host tier's hits) are still scattered."""

    def __init__(self) -> None:
        self._kv_caches: list[torch.Tensor] = []

    def attach(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self._kv_caches = list(kv_caches)

    def load(self, loads: Sequence[LoadSpec]) -> None:
        scatter_loads(loads, self._kv_caches)

    def track(self, spec: SaveSpec) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass

    def save_completed(self, context: LayerSaveContext) -> None:
        pass

    def flush(self, timeout_s: float) -> bool:
        return True

    def close(self, timeout_s: float) -> None:
        pass
