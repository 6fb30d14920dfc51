"""The connector's room for the decode's receives (`ReceiveControl`).

The decode service reserves a request's uncached prompt blocks for one transfer
(`prepare_receive`, which gives the hand-off for the prefill service), then settles it with
the prefill's verdict (`complete_receive`: only a transfer whose every block arrived and
verified, or that a store can still supply, is accepted) or drops it (`cancel_receive`). The
transports deliver into the `CacheSink`, which refuses any write to a block not reserved for
that transfer, so no late write lands in a freed block.

Callers: the decode service on any thread; the worker half on the engine's thread
(`expire_overdue` after each step).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from pdserve.common.errors import InvalidRequestError, TransferError
from pdserve.common.util import cdiv
from pdserve.engine.connector import KVCacheLayout
from pdserve.kvtransfer.chain import FallbackChain
from pdserve.kvtransfer.codec import ephemeral_key, new_transfer_id
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.params import TransferParams
from pdserve.kvtransfer.receive import land_from_store
from pdserve.kvtransfer.backend_loader import OpenedBackends
from pdserve.kvtransfer.sink import CacheSink, limits_for
from pdserve.kvtransfer.verdict import TransferVerdict

log = logging.getLogger("pdserve.kvtransfer.connector")


@dataclass(slots=True)
class _Receive:
    transfer_id: bytes
    dst_block_ids: tuple[int, ...]


class DecodeReceives:
    def __init__(self, config: KVTransferConfig, backends: OpenedBackends, chain: FallbackChain,
                 layout: KVCacheLayout, *, listen: bool) -> None:
        """`listen`: open the transports' receivers once the cache is attached (a decode)."""
        self.config = config
        self.backends = backends
        self.chain = chain
        self.layout = layout
        self.limits = limits_for(layout)
        self._listen = listen
        self._lock = threading.Lock()
        self._receives: dict[str, _Receive] = {}
        self._endpoints: dict[str, str] = {}
        self.sink: CacheSink | None = None  # the engine attaches its cache right after building us

    def attach(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """The engine's cache: the sink lands transfers in it; transports listen now."""
        self.sink = CacheSink(list(kv_caches), self.layout)
        if not self._listen:
            return
        for name, transport in self.backends.transports.items():
            try:
                self._endpoints[name] = transport.open_receiver(self.sink)
            except Exception as exc:  # noqa: BLE001 - a transport that cannot listen is skipped, with a reason
                self.backends.unavailable[name] = self.chain.unavailable[name] = f"cannot listen: {exc}"
                log.warning("kv transport %s cannot listen: %s", name, exc)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def endpoints(self) -> dict[str, str]:
        return dict(self._endpoints)

    def prepare_receive(self, request_id: str, block_ids: Sequence[int], num_prompt_tokens: int,
                        num_leading_blocks: int, deadline: float,
                        transfer_id: bytes | None = None, block_hashes: Sequence[int] | None = None) -> TransferParams:
        """Reserve the request's prompt blocks after the first `num_leading_blocks` (its local
        prefix hit) for a transfer until `deadline` (time.time()); returns the hand-off to
        give the prefill service. `block_ids`: the request's blocks in order. With
        `block_hashes` (ours, of the prompt's full blocks), each block must arrive under its
        hash (a partial last block under its short-lived key): another is refused."""
        if self.sink is None:
            raise TransferError("the connector has no cache registered")
        num_prompt_blocks = cdiv(num_prompt_tokens, self.layout.block_size)
        dst = tuple(block_ids[num_leading_blocks:num_prompt_blocks])
        transfer_id = transfer_id or new_transfer_id()
        keys = None if block_hashes is None else tuple(
            block_hashes[i] if i < len(block_hashes) else ephemeral_key(transfer_id, i)
            for i in range(num_leading_blocks, num_prompt_blocks))
        with self._lock:
            if request_id in self._receives:
                raise InvalidRequestError(f"request {request_id} already has a receive")
            self.sink.expect(transfer_id, dst, time.monotonic() + (deadline - time.time()), tag=request_id,
                             block_keys=keys)
            self._receives[request_id] = _Receive(transfer_id, dst)
        return TransferParams(transfer_id, dst, num_leading_blocks, deadline, self.limits.compat_hash,
                              tuple(self._endpoints.items()), self.config.backends)

    def complete_receive(self, request_id: str, verdict: TransferVerdict) -> TransferVerdict:
        """Settle a receive with the sender's verdict; returns this side's verdict. `ok`:
        the blocks are in place (decode from them); otherwise recompute (or fail) — the
        reservation is dropped first, so no late write can land in the blocks."""
        with self._lock:
            receive = self._receives.pop(request_id, None)
        if receive is None:
            raise InvalidRequestError(f"request {request_id} has no receive in progress")
        final = self._settle(receive, verdict)
        if not final.ok:
            self.sink.abort(receive.transfer_id)
        (log.info if final.ok else log.warning)("request %s: %s", request_id, final.describe())
        return final

    def _settle(self, receive: _Receive, verdict: TransferVerdict) -> TransferVerdict:
        if not verdict.ok:
            return verdict
        if verdict.transfer_id != receive.transfer_id.hex():
            return verdict.with_fallback(verdict.backend, "verdict is for another transfer")
        if self.sink.is_complete(receive.transfer_id):
            return verdict
        if not verdict.via_store:
            return verdict.with_fallback(verdict.backend, "the receiver did not get every block")
        store = self.backends.stores.get(verdict.backend)
        if store is None:
            return verdict.with_fallback(verdict.backend, "not configured on the receiver")
        start = time.monotonic()
        try:
            land_from_store(store, self.sink, receive.transfer_id, receive.dst_block_ids, verdict.fetch_keys)
        except TransferError as exc:
            return verdict.with_fallback(verdict.backend, f"fetch failed: {exc}",
                                         time.monotonic() - start)
        return verdict

    def cancel_receive(self, request_id: str) -> bool:
        """Drop a receive (abort, prefill failed); call before the engine frees the blocks."""
        with self._lock:
            receive = self._receives.pop(request_id, None)
        return receive is not None and self.sink.abort(receive.transfer_id)

    def expire_overdue(self) -> None:
        """End the reservations past their deadline (the service settles them by verdict)."""
        if self.sink is not None:
            self.sink.expire_overdue()
            self.sink.take_events()

    def close(self, timeout_s: float = 30.0) -> None:
        """Abort every pending receive; later writes are refused. Idempotent."""
        if self.sink is not None:
            self.sink.close()
