"""pdserve's connector: the engine's two halves over the transfer layer.

    scheduler.py     the scheduler half: store lookups, which prompts to save or send
    worker.py        the worker half: the engine's contract, handing the work to the rooms
    prefix_store.py  the prefix-store room: loads (scheduler side) and saves (worker side)
    sends.py         the prefill's sends, the engine thread's side: streams, whole sends
    send_control.py  the prefill's sends, the service's side (SendControl): verdicts, aborts
    send_book.py     what those two share: the sends by request id, the verdict board
    connections.py   a prefill's transports started and links opened ahead of its sends
    receives.py      the decode's receives (ReceiveControl): reservations, settlement
    metadata.py      what the scheduler half tells the worker half each step
    background.py    a room's own threads

Two uses, both optional, on the same pair:

* tiers under the pool (`kvtransfer.tiers`): blocks the pool evicts go to the host tier
  (`KVTransferConfig.host_offload_bytes`) and from there to the prefix store; a prompt's
  blocks found in any tier are loaded before its forward.
* persistent prefix cache (`KVTransferConfig.prefix_cache`, a store's name): a prompt's
  full blocks found in the store beyond the local prefix hit are fetched and verified by the
  scheduler half, scattered into the allocated blocks before the forward, and every newly
  completed full prompt block is stored in the background.
* disaggregation: the prefill's sends go out of `PdConnector.sends`, the decode reserves and
  settles its receives through `PdConnector.receives`; transports deliver into the sink.

The engine builds the connector once its cache is sized (`connector_factory`), so each
half gets the cache layout when it is made.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pdserve.engine.connector import Connector, KVCacheLayout
from pdserve.kvtransfer.chain import FallbackChain
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.connector.metadata import LoadSpec, PdConnectorMetadata, SaveSpec, SendSpec
from pdserve.kvtransfer.connector.prefix_store import NoStoreLoads, NoStoreSaves, StoreLoads, StoreSaves
from pdserve.kvtransfer.connector.receives import DecodeReceives
from pdserve.kvtransfer.connector.scheduler import PdConnectorScheduler
from pdserve.kvtransfer.connector.connections import Connections
from pdserve.kvtransfer.connector.send_book import SendBook, VerdictBoard
from pdserve.kvtransfer.connector.send_control import ServiceSends
from pdserve.kvtransfer.connector.sends import EngineSends
from pdserve.kvtransfer.connector.worker import PdConnectorWorker
from pdserve.kvtransfer.backend_loader import open_backends

__all__ = ["LoadSpec", "PdConnector", "PdConnectorMetadata", "PdConnectorScheduler", "PdConnectorWorker",
           "SaveSpec", "SendSpec", "VerdictBoard", "build_connector", "connector_factory"]


@dataclass(frozen=True, slots=True)
class PdConnector(Connector):
    """The engine's pair, plus the rooms the services drive transfers through: `sends`
    (`SendControl`, a prefill's) and `receives` (`ReceiveControl`, a decode's)."""

    sends: ServiceSends = field(kw_only=True)

    @property
    def receives(self) -> DecodeReceives:
        return self.worker.receives

    @property
    def tiers(self):
        """The tiers under the pool: their stats, and `set_on_event` for their events."""
        return self.worker.tiers


def build_connector(config: KVTransferConfig, layout: KVCacheLayout, *, listen: bool = True) -> PdConnector:
    """The pdserve connector pair for an engine whose cache has `layout`. `listen`: open the
    transports' receivers (decode workers); a prefill passes False and warms its senders."""
    backends = open_backends(config)
    chain = FallbackChain(config.backends, transports=backends.transports, stores=backends.stores,
                          unavailable=backends.unavailable, step_timeout_s=config.step_timeout_s,
                          health_policy=config.health_policy)
    store = backends.stores.get(config.prefix_cache) if config.prefix_cache else None
    if store is None:
        store_loads, saves = NoStoreLoads(), NoStoreSaves()
    else:
        store_loads, saves = StoreLoads(store, layout), StoreSaves(store, layout)
    from pdserve.kvtransfer.tiers import TieredLoads, Tiers  # the tiers import this package's rooms

    tiers = Tiers(layout, config.host_offload_bytes, store)
    loads = TieredLoads(tiers.host, store_loads, layout, tiers.lower.stats if tiers.lower is not None else None)
    book, connections = SendBook(), Connections(backends, config.step_timeout_s)
    sends = EngineSends(config, backends, chain, layout, book, connections, warm_up=not listen)
    worker = PdConnectorWorker(layout, saves, sends, DecodeReceives(config, backends, chain, layout, listen=listen),
                               chain, tiers)
    return PdConnector(scheduler=PdConnectorScheduler(loads, layout), worker=worker,
                       sends=ServiceSends(book, chain, connections))


def connector_factory(config: KVTransferConfig, *, listen: bool = True) -> Callable[[KVCacheLayout], PdConnector]:
    """What an engine is built with: it calls this with its cache layout once the cache is sized."""
    return lambda layout: build_connector(config, layout, listen=listen)
