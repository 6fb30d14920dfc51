"""The receiving end of every transfer: checks messages and scatters them into the cache.

A transfer is *expected* before any byte may land: `expect(transfer_id, block_ids, deadline)`
reserves destination blocks the engine already allocated. A message is accepted only if

* its header passes `WireLimits` (compatibility hash, layout, sizes),
* its transfer id is pending: not unknown, not finished (duplicate), not aborted, not late,
* every destination block it names is one of the transfer's reserved blocks,
* each block comes under the key (block hash) reserved for it, when the owner named keys,
* its checksum matches.

A message carries some layers of some blocks (a whole-block message all layers, a streamed
one a layer of a prefill chunk). The transfer completes when every layer of every reserved
block has landed — only then may the owner use the blocks — or ends at its deadline or on
`abort`. A message may rewrite layers that already landed: after a stream broke halfway the
fallback backend re-sends the blocks whole (the same bytes). A refused message leaves the
transfer pending (another backend in the chain may still land it). After `abort` returns, no write of that transfer can land: commits scatter under
the same lock. The sink never owns blocks; the engine frees them once the sink lets go.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pdserve.engine.connector import KVCacheLayout
from pdserve.common.errors import TransferError
from pdserve.kvtransfer.blocks import buffer_from_bytes, bytes_tensor, scatter_from_host
from pdserve.kvtransfer.codec import as_bytes_view, decode_message
from pdserve.kvtransfer.wire import (
    BlockHeader, WireError, WireLimits, is_device_payload, parse_index, verify_payload,
)

_HISTORY = 4096  # finished transfer ids remembered to refuse duplicates and late writes


@dataclass(frozen=True, slots=True)
class SinkEvent:
    """A transfer that ended on its own: all blocks filled (ok) or deadline passed."""

    tag: str  # what the owner passed to `expect` (the request id)
    transfer_id: bytes
    ok: bool
    reason: str = ""


@dataclass(slots=True)
class _Pending:
    tag: str
    block_ids: tuple[int, ...]
    missing: dict[int, int]  # block id -> bit mask of the layers not landed yet (0: done)
    deadline: float
    num_bytes: int = 0
    keys: dict[int, int] | None = None  # block id -> the hash it must arrive under (None: any)

    @property
    def num_missing(self) -> int:
        return sum(1 for mask in self.missing.values() if mask)


def limits_for(layout: KVCacheLayout) -> WireLimits:
    return WireLimits(compat_hash=layout.compatibility_hash(), dtype=layout.dtype,
                      num_layers=layout.num_layers, block_size=layout.block_size,
                      num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                      max_blocks=layout.num_blocks)


class CacheSink:
    """A `BlockSink` over the engine's per-layer cache tensors. Thread-safe."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], layout: KVCacheLayout, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if len(kv_caches) != layout.num_layers:
            raise ValueError(f"{len(kv_caches)} cache tensors for {layout.num_layers} layers")
        self.kv_caches = list(kv_caches)
        self.layout = layout
        self._limits = limits_for(layout)
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[bytes, _Pending] = {}
        self._ended: OrderedDict[bytes, str] = OrderedDict()  # id -> "completed"/"aborted"/...
        self._events: list[SinkEvent] = []
        self.num_refused = 0

    # -- the owner's side ---------------------------------------------------------------
    def expect(self, transfer_id: bytes, block_ids: Sequence[int], deadline: float,
               tag: str = "", block_keys: Sequence[int] | None = None) -> None:
        """Reserve `block_ids` for `transfer_id` until `deadline` (time.monotonic). With
        `block_keys`, block_ids[i] accepts only a block whose index entry names block_keys[i]."""
        ids = tuple(int(b) for b in block_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ValueError("a transfer needs distinct destination blocks")
        if block_keys is not None and len(block_keys) != len(ids):
            raise ValueError(f"{len(block_keys)} block keys for {len(ids)} blocks")
        if not all(0 <= b < self.layout.num_blocks for b in ids):
            raise ValueError(f"destination blocks outside the pool of {self.layout.num_blocks}")
        with self._lock:
            if transfer_id in self._pending or transfer_id in self._ended:
                raise TransferError(f"transfer {transfer_id.hex()} is already known")
            busy = set(ids) & self._reserved_locked()
            if busy:
                raise TransferError(f"blocks {sorted(busy)[:8]} are reserved by another transfer")
            every_layer = (1 << self.layout.num_layers) - 1
            keys = None if block_keys is None else {b: int(k) for b, k in zip(ids, block_keys)}
            self._pending[transfer_id] = _Pending(tag, ids, dict.fromkeys(ids, every_layer), deadline, keys=keys)

    def abort(self, transfer_id: bytes) -> bool:
        """Forget a pending transfer; later writes to it are refused. True if it was pending."""
        with self._lock:
            pending = self._pending.pop(transfer_id, None)
            if pending is not None:
                self._end_locked(transfer_id, "aborted")
            return pending is not None

    def expire_overdue(self) -> None:
        """End every transfer past its deadline (reported by `take_events`)."""
        now = self._clock()
        with self._lock:
            for tid in [t for t, p in self._pending.items() if now > p.deadline]:
                self._expire_locked(tid)

    def take_events(self) -> list[SinkEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def is_complete(self, transfer_id: bytes) -> bool:
        with self._lock:
            return self._ended.get(transfer_id) == "completed"

    @property
    def pending_transfer_ids(self) -> set[bytes]:
        with self._lock:
            return set(self._pending)

    @property
    def reserved_block_ids(self) -> set[int]:
        with self._lock:
            return self._reserved_locked()

    def close(self) -> None:
        """Abort every pending transfer. Idempotent."""
        with self._lock:
            for tid in list(self._pending):
                del self._pending[tid]
                self._end_locked(tid, "aborted")

    # -- the BlockSink contract (transports call these) ---------------------------------
    @property
    def limits(self) -> WireLimits:
        return self._limits

    def check(self, header: BlockHeader, index: bytes | memoryview) -> None:
        with self._lock:
            self._check_locked(header, index)

    def staging(self, header: BlockHeader, on_device: bool = False) -> torch.Tensor:
        # header passed `limits` already: payload_len is bounded by the pool size
        device = self.kv_caches[0].device if on_device and self.kv_caches[0].is_cuda else "cpu"
        return torch.empty(header.payload_len, dtype=torch.uint8, device=device)

    def commit(self, header: BlockHeader, index: bytes | memoryview, payload: object) -> None:
        try:
            # a GPU payload (device-direct nccl) is checked and scattered where it is
            view = payload if is_device_payload(payload) else as_bytes_view(payload)
            if header.device_digest and not is_device_payload(view) and self.kv_caches[0].is_cuda:
                # a GPU sender's message that came through a host transport: its digest is
                # quick on the GPU (slow on the CPU), and the bytes go there anyway
                view = bytes_tensor(view).to(self.kv_caches[0].device)
            verify_payload(header, index, view)  # outside the lock: it does not touch the cache
            layers = header.layers
            caches = self.kv_caches[layers.start:layers.stop]
            buffer = buffer_from_bytes(view, header.num_blocks, caches)
        except WireError:
            self._refused()
            raise
        landed = ~sum(1 << layer for layer in layers)
        with self._lock:
            block_ids = self._check_locked(header, index)
            pending = self._pending[header.transfer_id]
            scatter_from_host(buffer, caches, block_ids)
            for b in block_ids:
                pending.missing[b] &= landed
            pending.num_bytes += header.payload_len
            if not pending.num_missing:
                del self._pending[header.transfer_id]
                self._end_locked(header.transfer_id, "completed")
                self._events.append(SinkEvent(pending.tag, header.transfer_id, True))

    def deliver(self, data: bytes | memoryview) -> None:
        """Check and commit one complete message held in memory (store fetches, tests)."""
        try:
            message = decode_message(data, self._limits, self.layout.num_blocks)
        except WireError:
            self._refused()
            raise
        self.check(message.header, message.index)
        self.commit(message.header, message.index, message.payload)

    # -- internals (call with the lock held) --------------------------------------------
    def _check_locked(self, header: BlockHeader, index: bytes | memoryview) -> list[int]:
        tid = header.transfer_id
        lim = self._limits
        if (header.compat_hash, header.dtype, header.num_layers, header.block_size,
                header.num_kv_heads, header.head_dim) != (
                lim.compat_hash, lim.dtype, lim.num_layers, lim.block_size, lim.num_kv_heads,
                lim.head_dim):
            self.num_refused += 1
            raise WireError("header does not match this cache's layout (parsed with other limits)")
        pending = self._pending.get(tid)
        if pending is None:
            self.num_refused += 1
            ended = self._ended.get(tid)
            if ended == "completed":
                raise TransferError(f"duplicate transfer id {tid.hex()}: already completed")
            if ended is not None:
                raise TransferError(f"transfer {tid.hex()} was {ended}")
            raise TransferError(f"unknown transfer id {tid.hex()}")
        if self._clock() > pending.deadline:
            self._expire_locked(tid)
            self.num_refused += 1
            raise TransferError(f"transfer {tid.hex()} passed its deadline")
        try:
            block_ids, keys = parse_index(header, index, self.layout.num_blocks)
        except WireError:
            self.num_refused += 1
            raise
        stray = [b for b in block_ids if b not in pending.missing]
        if stray:
            self.num_refused += 1
            raise TransferError(f"blocks {stray[:8]} are not open for transfer {tid.hex()}")
        if pending.keys is not None:
            wrong = [b for b, k in zip(block_ids, keys) if pending.keys[b] != k]
            if wrong:
                self.num_refused += 1
                raise TransferError(f"blocks {wrong[:8]} of transfer {tid.hex()} carry block hashes "
                                    "other than the ones reserved for them")
        return block_ids

    def _expire_locked(self, tid: bytes) -> None:
        pending = self._pending.pop(tid)
        self._end_locked(tid, "expired")
        self._events.append(SinkEvent(pending.tag, tid, False, "deadline passed before the "
                                      f"blocks arrived ({pending.num_missing} incomplete)"))

    def _end_locked(self, tid: bytes, how: str) -> None:
        self._ended[tid] = how
        while len(self._ended) > _HISTORY:
            self._ended.popitem(last=False)

    def _reserved_locked(self) -> set[int]:
        return {b for p in self._pending.values() for b in p.block_ids}

    def _refused(self) -> None:
        with self._lock:
            self.num_refused += 1
