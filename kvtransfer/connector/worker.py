"""The connector's worker half: the engine's contract, and nothing else. The work is done by
three rooms, each with its own threads: `StoreSaves` (prefix-store loads and saves),
`EngineSends` (the engine's side of the prefill's sends; the service's side is
`ServiceSends`, `PdConnector.sends`) and `DecodeReceives` (the decode's receives)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import torch

from pdserve.engine.connector import (
    BackendState, ConnectorMetadata, KVCacheLayout, KVConnectorWorker, LayerSaveContext,
)
from pdserve.kvtransfer.chain import FallbackChain
from pdserve.kvtransfer.connector.metadata import PdConnectorMetadata
from pdserve.kvtransfer.connector.prefix_store import NoStoreSaves, StoreSaves
from pdserve.kvtransfer.connector.receives import DecodeReceives
from pdserve.kvtransfer.connector.sends import EngineSends

if TYPE_CHECKING:  # the tiers import the connector's rooms
    from pdserve.kvtransfer.tiers import Tiers


class PdConnectorWorker(KVConnectorWorker):
    def __init__(self, layout: KVCacheLayout, saves: StoreSaves | NoStoreSaves, sends: EngineSends,
                 receives: DecodeReceives, chain: FallbackChain, tiers: "Tiers | None" = None) -> None:
        self.layout = layout
        self.saves = saves
        self.sends = sends
        self.receives = receives
        self.chain = chain
        if tiers is None:
            from pdserve.kvtransfer.tiers import Tiers

            tiers = Tiers(layout, 0, None)
        self.tiers = tiers
        self._context: LayerSaveContext | None = None  # the step's, from its first saved layer

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor], layout: KVCacheLayout) -> None:
        if layout != self.layout:
            raise ValueError(f"the connector was built for {self.layout}, not {layout}")
        for room in (self.saves, self.sends, self.receives, self.tiers):
            room.attach(kv_caches)

    def register_block_pool(self, kv: object) -> None:
        self.tiers.register_block_pool(kv)

    def backend_states(self) -> list[BackendState]:
        return self.chain.states()

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        if not isinstance(metadata, PdConnectorMetadata):
            return
        self.saves.load(metadata.loads)
        for save in metadata.saves:
            self.saves.track(save)
        for send in metadata.sends:
            self.sends.announce(send)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        pass  # loads are scattered whole in start_load_kv, before the forward

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, context: LayerSaveContext) -> None:
        self._context = context
        self.sends.add_layer(layer_idx, kv_layer, context)

    def wait_for_save(self) -> None:
        """Gather what completed this step (synchronously: the blocks may be reused after)
        and hand the writes and sends to the rooms' threads."""
        context, self._context = self._context, None
        if context is None:
            return
        forward_end = time.monotonic()  # every layer of this step is written
        self.saves.save_completed(context)
        self.sends.end_step(context, forward_end)

    def get_finished(self, finished_request_ids: set[str]) -> set[str]:
        """Sends done of requests the engine has ended (each end is told here, once). Also
        ends the receives past their deadline."""
        for rid in finished_request_ids:
            self.saves.forget(rid)
            self.sends.finished(rid)
        self.receives.expire_overdue()
        return self.sends.take_done()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for background stores and sends. False if some still run at the deadline."""
        return self.saves.flush(timeout_s) and self.sends.flush(timeout_s) and self.tiers.flush(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish background work (up to `timeout_s`), stop listening, close the backends."""
        self.saves.close(timeout_s)
        self.sends.close(timeout_s)
        self.receives.close(timeout_s)
        self.tiers.close(timeout_s)
        self.chain.close()
