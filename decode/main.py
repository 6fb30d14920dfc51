"""`pdserve decode`: one decode service."""
from __future__ import annotations

import asyncio
from typing import Any

from pdserve.deploy.worker import WorkerSettings, run_worker


class DecodeBuild:
    @staticmethod
    def make_connector(settings: WorkerSettings):
        from pdserve.engine.connector import Connector

        if not settings.backends:
            return Connector()  # local prefill only
        from pdserve.kvtransfer.service import make_connector_for_decode

        return make_connector_for_decode(settings)

    @staticmethod
    async def make_service(runtime):
        from pdserve.decode.prefill_leg import PrefillLeg
        from pdserve.decode.servicer import DecodeService
        from pdserve.proto.pdserve.v1 import decode_pb2, decode_pb2_grpc

        receiver = make_receiver(runtime)
        leg = PrefillLeg(receiver, worker_id=runtime.settings.worker_id or "decode",
                         compat_hash=runtime.engine.compat_hash,
                         block_size=runtime.engine.kv.block_size,
                         timeout_s=runtime.settings.prefill_timeout_s)
        service = DecodeService(runtime.loop, runtime.settings, runtime.served_name, leg, runtime.metrics)

        def add(server):
            decode_pb2_grpc.add_DecodeServicer_to_server(service, server)

        async def close():
            await leg.close()
            receiver_close = getattr(receiver, "close", None)
            if receiver_close is not None:
                receiver_close()

        return add, [decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name], close


def make_receiver(runtime):
    """Decode's KV receiver for the configured backends (none configured: local prefill only)."""
    from pdserve.decode.prefill_leg import NoReceiver

    if not runtime.settings.backends:
        return NoReceiver()
    from pdserve.kvtransfer.service import Receiver

    return Receiver(runtime.engine.connector, runtime.settings)


def main(settings: dict[str, Any]) -> int:
    return asyncio.run(run_worker("decode", WorkerSettings.from_settings("decode", settings), DecodeBuild))
