"""`pdserve decode`: one decode service."""
from __future__ import annotations

import asyncio
from typing import Any

from pdserve.worker.runtime import run_worker
from pdserve.worker.settings import WorkerSettings


class DecodeBuild:
    """How `run_worker` builds a decode service: its connector (none for local prefill only
    without a prefix store or a host tier), then its gRPC service, whose prefill leg drives transfers through
    that connector's `receives`."""

    def make_connector(self, settings: WorkerSettings, secret=None):
        from pdserve.engine.connector import Connector

        if not settings.backends and settings.prefix_store == "none" and not settings.kv_offload_host_gb:
            return Connector()
        from pdserve.worker.transfer import make_connector

        return make_connector(settings, secret, listen=True)

    async def make_service(self, runtime):
        from pdserve.decode.prefill_leg import PrefillLeg, RemotePrefill
        from pdserve.decode.servicer import DecodeService
        from pdserve.decode.session import DecodeSessions
        from pdserve.kvtransfer.connector import PdConnector
        from pdserve.proto.pdserve.v1 import decode_pb2, decode_pb2_grpc

        settings = runtime.settings
        leg = PrefillLeg(make_receives(runtime), worker_id=runtime.worker_id,
                         compat_hash=runtime.engine.compat_hash,
                         block_size=runtime.engine.kv.block_size,
                         timeout_s=settings.prefill_timeout_s, auth=runtime.auth)
        remote = RemotePrefill(leg, runtime.loop, failure_policy=settings.failure_policy,
                               timeout_s=settings.prefill_timeout_s)
        service = DecodeService(DecodeSessions(runtime.loop, remote, runtime.metrics, runtime.adapters),
                                runtime.served_name)

        def add(server):
            decode_pb2_grpc.add_DecodeServicer_to_server(service, server)

        async def close():
            await leg.close()
            connector = runtime.engine.connector
            if isinstance(connector, PdConnector):  # its tiers' memory too
                connector.worker.close()

        return add, [decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name], close


def make_receives(runtime):
    """Decode's `ReceiveControl` for the configured backends (none configured: local prefill
    only, `NoReceives`)."""
    if not _receives_through(runtime.engine.connector, runtime.settings):
        from pdserve.kvtransfer.ports import NoReceives

        return NoReceives()
    from pdserve.worker.transfer import AdvertisedReceives

    return AdvertisedReceives(runtime.engine.connector.receives, runtime.settings)


def _receives_through(connector, settings: WorkerSettings) -> bool:
    """Whether transfers land through `connector` (a pdserve connector with KV backends)."""
    from pdserve.kvtransfer.connector import PdConnector

    return isinstance(connector, PdConnector) and bool(settings.backends)


def main(settings: dict[str, Any]) -> int:
    return asyncio.run(run_worker("decode", WorkerSettings.from_settings("decode", settings), DecodeBuild()))
