"""`pdserve prefill`: one prefill service."""
from __future__ import annotations

import asyncio
from typing import Any

from pdserve.deploy.worker import WorkerSettings, run_worker


class PrefillBuild:
    _sender = None

    @classmethod
    def make_connector(cls, settings: WorkerSettings):
        from pdserve.kvtransfer.service import make_sender

        cls._sender = make_sender(settings)
        return cls._sender.connector

    @classmethod
    async def make_service(cls, runtime):
        from pdserve.prefill.servicer import PrefillService
        from pdserve.proto.pdserve.v1 import prefill_pb2, prefill_pb2_grpc

        sender = cls._sender
        service = PrefillService(runtime.loop, runtime.settings, runtime.served_name, sender, runtime.metrics)

        def add(server):
            prefill_pb2_grpc.add_PrefillServicer_to_server(service, server)

        async def close():
            sender.close()

        return add, [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name], close


def main(settings: dict[str, Any]) -> int:
    return asyncio.run(run_worker("prefill", WorkerSettings.from_settings("prefill", settings), PrefillBuild))
