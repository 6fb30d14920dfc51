"""KV transfer: moves KV cache blocks between workers and to/from stores.

    wire.py, codec.py   the binary format (no pickle) and whole-message helpers
    base.py             KVTransport (ucx, nccl), BlockSink, BlockStore (redis, disk) contracts
    sink.py             CacheSink: checks messages, scatters them into the paged cache
    chain.py            fallback chain over the backends, with health; verdict.py: its outcome
    backend_loader.py   backends by name, imported lazily; config.py: KVTransferConfig
    connector/          the engine's connector: its two halves and the rooms for prefix-store
                        loads/saves, prefill sends and decode receives
    params.py           TransferParams: the hand-off a decode service gives a prefill service

Importing this package is cheap: backends and torch load only when used.
"""
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.params import ReceiveParams, TransferParams
from pdserve.kvtransfer.verdict import Fallback, Outcome, TransferVerdict

__all__ = ["KVTransferConfig", "ReceiveParams", "TransferParams", "Fallback", "Outcome",
           "TransferVerdict", "connector_factory"]


def connector_factory(config: KVTransferConfig, *, listen: bool = True):
    """What an engine is built with for `config` (see connector.connector_factory)."""
    from pdserve.kvtransfer.connector import connector_factory as factory

    return factory(config, listen=listen)
