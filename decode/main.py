"""`pdserve decode`: one decode service."""
from __future__ import annotations

import asyncio
from typing import Any

from pdserve.worker.runtime import run_worker
from pdserve.worker.settings import WorkerSettings


class DecodeBuild:
    """How `run_worker` builds a decode service: its connector (none for local prefill only
    without a prefix store), then its gRPC service, whose KV receiver drives transfers through
    that connector's `receives`."""

    def make_connector(self, settings: WorkerSettings, secret=None):
        from pdserve.engine.connector import Connector

        if not settings.backends and settings.prefix_store == "none":
            return Connector()
        from pdserve.worker.transfer import make_connector

        return make_connector(settings, secret, listen=True)

    async def make_service(self, runtime):
        from pdserve.decode.prefill_leg import PrefillLeg, RemotePrefill
        from pdserve.decode.servicer import DecodeService
        from pdserve.decode.session import DecodeSessions
        from pdserve.proto.pdserve.v1 import decode_pb2, decode_pb2_grpc

        settings = runtime.settings
        receiver = make_receiver(runtime)
        leg = PrefillLeg(receiver, worker_id=runtime.worker_id,
                         compat_hash=runtime.engine.compat_hash,
                         block_size=runtime.engine.kv.block_size,
                         timeout_s=settings.prefill_timeout_s, auth=runtime.auth)
        remote = RemotePrefill(leg, runtime.loop, failure_policy=settings.failure_policy,
                               timeout_s=settings.prefill_timeout_s)
        service = DecodeService(DecodeSessions(runtime.loop, remote, runtime.metrics), runtime.served_name)

        def add(server):
            decode_pb2_grpc.add_DecodeServicer_to_server(service, server)

        async def close():
            await leg.close()
            receiver.close()

        return add, [decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name], close


def make_receiver(runtime):
    """Decode's KV receiver for the configured backends (none configured: local prefill only)."""
    from pdserve.decode.prefill_leg import NoReceiver
    from pdserve.kvtransfer.connector import PdConnector

    connector = runtime.engine.connector
    if not isinstance(connector, PdConnector) or not runtime.settings.backends:
        return NoReceiver()
    from pdserve.worker.transfer import Receiver

    return Receiver(connector, runtime.settings)


def main(settings: dict[str, Any]) -> int:
    return asyncio.run(run_worker("decode", WorkerSettings.from_settings("decode", settings), DecodeBuild()))
