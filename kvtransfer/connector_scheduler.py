"""The connector's scheduler half: prefix-cache lookups and what to load, save and send.

It sees requests, block ids and block hashes, never tensors. Store lookups happen here,
before allocation, and fetch + verify the payloads then: a block that vanishes between the
lookup and the load (pruned by another process, corrupt) can then never leave the engine
believing in tokens it does not have.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from pdserve.engine.connector import (
    ConnectorMetadata, ConnectorRequest, KVCacheLayout, KVConnectorScheduler,
)
from pdserve.common.errors import InvalidRequestError
from pdserve.kvtransfer.base import BlockStore
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.connector_meta import (
    LayoutBox, LoadSpec, PdConnectorMetadata, SaveSpec, SendSpec,
)
from pdserve.kvtransfer.params import ReceiveParams, TransferParams
from pdserve.kvtransfer.sink import limits_for

log = logging.getLogger("pdserve.kvtransfer.connector")


@dataclass(slots=True)
class _Lookup:
    start_block: int
    payloads: tuple[memoryview, ...]


class PdConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, prefix_store: BlockStore | None,
                 layout_box: LayoutBox) -> None:
        self.config = config
        self.store = prefix_store
        self._layout = layout_box
        self._lookups: dict[str, _Lookup] = {}  # fetched hits waiting for allocation
        self._announced: dict[tuple[str, str], SaveSpec | SendSpec] = {}  # last spec sent
        self._meta = PdConnectorMetadata()
        self.num_matched_blocks = 0  # store blocks offered to the engine, all requests

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> int:
        params = request.transfer_params
        if isinstance(params, ReceiveParams):
            return 0  # a remote prefill fills this one (the decode service drives it)
        if isinstance(params, TransferParams):
            self._announce(request.request_id, SendSpec(
                request.request_id, params, len(request.prompt_token_ids), request.block_hashes))
        layout = self._layout.layout
        if self.store is None or layout is None:
            return 0
        bs = layout.block_size
        start = num_computed_tokens // bs
        hits = self._lookup(request, start, layout)
        self._announce(request.request_id,
                       SaveSpec(request.request_id, request.block_hashes, start + hits))
        return hits * bs

    def _lookup(self, request: ConnectorRequest, start: int, layout: KVCacheLayout) -> int:
        """Full blocks from `start` on that the store holds, fetched and verified now. At
        least one prompt token is always left to compute (its logits give the next token)."""
        cached = self._lookups.get(request.request_id)
        if cached is not None and cached.start_block == start:
            return len(cached.payloads)
        max_blocks = (len(request.prompt_token_ids) - 1) // layout.block_size
        keys = request.block_hashes[start:max_blocks]
        if not keys:
            return 0
        compat = layout.compatibility_hash()
        n = self.store.count_prefix_hits(keys, compat)
        payloads: list[memoryview] = []
        for payload in self.store.get(keys[:n], limits_for(layout)) if n else ():
            if payload is None:  # pruned or corrupt since counted: keep the prefix
                break
            payloads.append(payload)
        self._lookups[request.request_id] = _Lookup(start, tuple(payloads))  # retries reuse it
        self.num_matched_blocks += len(payloads)
        log.info("prefix cache (%s): request %s matched %d of %d blocks beyond %d local",
                 self.store.name, request.request_id, len(payloads), len(keys), start)
        return len(payloads)

    def _announce(self, request_id: str, spec: SaveSpec | SendSpec) -> None:
        key = (type(spec).__name__, request_id)
        if self._announced.get(key) == spec:
            return
        self._announced[key] = spec
        (self._meta.saves if isinstance(spec, SaveSpec) else self._meta.sends).append(spec)

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """`block_ids`: all of the request's blocks, in order (local prefix hit first)."""
        lookup = self._lookups.pop(request.request_id, None)
        if lookup is None or num_external_tokens <= 0 or not lookup.payloads:
            return
        layout = self._layout.layout
        num = min(num_external_tokens // layout.block_size, len(lookup.payloads))
        dst = tuple(block_ids[lookup.start_block:lookup.start_block + num])
        if len(dst) != num:
            raise InvalidRequestError(f"request {request.request_id}: {len(block_ids)} blocks "
                                      f"allocated, loads need {lookup.start_block + num}")
        self._meta.loads.append(LoadSpec(request.request_id, dst, lookup.payloads[:num]))

    def build_connector_meta(self) -> ConnectorMetadata:
        meta, self._meta = self._meta, PdConnectorMetadata()
        meta.request_ids = sorted({s.request_id for s in (*meta.loads, *meta.saves, *meta.sends)})
        return meta

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> bool:
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._announced.pop(("SaveSpec", rid), None)
        self._announced.pop(("SendSpec", rid), None)
        keep = isinstance(request.transfer_params, TransferParams)
        self._meta.finished.append((rid, keep))
        return keep
