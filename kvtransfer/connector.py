"""pdserve's connector: the engine's two connector halves over the transfer layer.

Two uses, both optional, on the same pair:

* persistent prefix cache (`KVTransferConfig.prefix_cache` = "disk" | "redis"): a prompt's
  full blocks found in the store beyond the local prefix hit are fetched and verified by the
  scheduler half (`get_num_new_matched_tokens`, so a later miss cannot strand the engine),
  scattered into the allocated blocks before the forward (`start_load_kv`), and every newly
  completed full prompt block is gathered after the forward and stored in the background
  (`save_kv_layer` / `wait_for_save`).
* disaggregation, prefill side: a request whose `transfer_params` is a `TransferParams` has
  its blocks gathered when its prefill completes and sent through the fallback chain in the
  background; `request_finished` keeps its blocks until `get_finished` reports the send
  done. The prefill service reads its `TransferVerdict` through `sends` (`SendControl`).
* disaggregation, decode side: the decode service reserves the allocated blocks through
  `receives` (`ReceiveControl.prepare_receive` -> the `TransferParams` for the prefill
  service), then settles the receive with the prefill's verdict (`complete_receive`) or
  drops it (`cancel_receive`). Transports deliver into the worker's sink.

Scheduler -> worker state travels only in `PdConnectorMetadata`. The one thing the scheduler
half reads from the worker side is the cache layout (`connector_meta.LayoutBox`), set once by
`register_kv_caches`: the scheduler ABC has no hook that hands it the layout, so both halves
share the box they are built with (`build_connector`).
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.connector import Connector
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.connector_meta import (
    LayoutBox, LoadSpec, PdConnectorMetadata, SaveSpec, SendSpec,
)
from pdserve.kvtransfer.connector_scheduler import PdConnectorScheduler
from pdserve.kvtransfer.connector_worker import PdConnectorWorker, VerdictBoard
from pdserve.kvtransfer.ports import ReceiveControl, SendControl
from pdserve.kvtransfer.registry import open_backends

__all__ = ["LoadSpec", "PdConnector", "PdConnectorMetadata", "PdConnectorScheduler",
           "PdConnectorWorker", "SaveSpec", "SendSpec", "VerdictBoard", "build_connector"]


@dataclass(frozen=True, slots=True)
class PdConnector(Connector):
    """The engine's pair, plus the typed surfaces the services drive transfers through."""

    @property
    def sends(self) -> SendControl:
        return self.worker

    @property
    def receives(self) -> ReceiveControl:
        return self.worker


def build_connector(config: KVTransferConfig, *, listen: bool = True) -> PdConnector:
    """The pdserve connector pair for an engine. `listen`: open the transports' receivers
    (decode workers); a prefill-only worker can pass False."""
    backends = open_backends(config)
    box = LayoutBox()
    store = backends.stores.get(config.prefix_cache) if config.prefix_cache else None
    return PdConnector(scheduler=PdConnectorScheduler(config, store, box),
                       worker=PdConnectorWorker(config, backends, store, box, listen=listen))
