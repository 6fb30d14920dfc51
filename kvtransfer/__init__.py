"""KV transfer: moves KV cache blocks between workers and to/from stores.

    wire.py, codec.py   the binary format (no pickle) and whole-message helpers
    base.py             KVTransport (ucx, nccl), BlockSink, BlockStore (redis, disk) contracts
    sink.py             CacheSink: checks messages, scatters them into the paged cache
    chain.py            fallback chain over the backends, with health; verdict.py: its outcome
    registry.py         backends by name, imported lazily; config.py: KVTransferConfig
    connector.py        the engine's connector halves (prefix cache + disaggregated hand-off)
    params.py           TransferParams: the hand-off a decode service gives a prefill service

Importing this package is cheap: backends and torch load only when used.
"""
from pdserve.kvtransfer.config import KVTransferConfig
from pdserve.kvtransfer.params import ReceiveParams, TransferParams
from pdserve.kvtransfer.verdict import Fallback, Outcome, TransferVerdict

__all__ = ["KVTransferConfig", "ReceiveParams", "TransferParams", "Fallback", "Outcome",
           "TransferVerdict", "build_connector"]


def build_connector(config: KVTransferConfig, *, listen: bool = True):
    """The engine's `Connector` pair for `config` (see connector.build_connector)."""
    from pdserve.kvtransfer.connector import build_connector as build

    return build(config, listen=listen)
