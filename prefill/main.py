"""`pdserve prefill`: one prefill service."""
from __future__ import annotations

import asyncio
from typing import Any

from pdserve.worker.runtime import run_worker
from pdserve.worker.settings import WorkerSettings


class PrefillBuild:
    """How `run_worker` builds a prefill service: a sending connector goes into the engine,
    then the service sends through its `sends`."""

    def make_connector(self, settings: WorkerSettings, secret=None):
        from pdserve.worker.transfer import make_connector

        return make_connector(settings, secret, listen=False)

    async def make_service(self, runtime):
        from pdserve.prefill.runner import PrefillRunner
        from pdserve.prefill.servicer import PrefillService
        from pdserve.proto.pdserve.v1 import prefill_pb2, prefill_pb2_grpc

        connector = runtime.engine.connector
        runner = PrefillRunner(runtime.loop, connector.sends, runtime.metrics, block_size=runtime.engine.kv.block_size,
                               max_queue=runtime.settings.max_queue, handoff_mac=runtime.auth.handoff_mac(),
                               core_share=runtime.core_share, adapters=runtime.adapters)
        service = PrefillService(runner, runtime.served_name)

        def add(server):
            prefill_pb2_grpc.add_PrefillServicer_to_server(service, server)

        async def close():
            connector.worker.close()

        return add, [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name], close


def main(settings: dict[str, Any]) -> int:
    return asyncio.run(run_worker("prefill", WorkerSettings.from_settings("prefill", settings), PrefillBuild()))
