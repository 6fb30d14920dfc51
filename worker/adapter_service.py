"""The Adapters gRPC service of every worker (the router's LoRA administration): convert,
delegate to `WorkerAdapters`, convert back. Errors are mapped by `rpc.errors.grpc_errors`."""
from __future__ import annotations

from pdserve.proto.pdserve.v1 import adapters_pb2, adapters_pb2_grpc
from pdserve.rpc.errors import grpc_errors
from pdserve.worker.lora import WorkerAdapters

SERVICE_NAME = adapters_pb2.DESCRIPTOR.services_by_name["Adapters"].full_name


class AdapterService(adapters_pb2_grpc.AdaptersServicer):
    def __init__(self, adapters: WorkerAdapters) -> None:
        self.adapters = adapters

    @grpc_errors
    async def LoadAdapter(self, request, context):
        return adapters_pb2.LoadAdapterResponse(adapter=await self.adapters.load(request.lora_name,
                                                                                 request.lora_path))

    @grpc_errors
    async def UnloadAdapter(self, request, context):
        return adapters_pb2.UnloadAdapterResponse(found=await self.adapters.unload(request.lora_name))


def add_adapter_service(server, adapters: WorkerAdapters) -> None:
    adapters_pb2_grpc.add_AdaptersServicer_to_server(AdapterService(adapters), server)
