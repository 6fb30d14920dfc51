"""The Prefill gRPC service: convert, delegate to `PrefillRunner`, convert back. Errors are
mapped by `rpc.errors.grpc_errors` from the one table."""
from __future__ import annotations

from pdserve.prefill.runner import PrefillRunner
from pdserve.proto.pdserve.v1 import common_pb2, prefill_pb2_grpc
from pdserve.worker.convert import load_to_proto, model_info
from pdserve.rpc.credentials import caller_id
from pdserve.rpc.errors import grpc_errors


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, runner: PrefillRunner, served_name: str) -> None:
        self.runner = runner
        self.served_name = served_name

    @grpc_errors
    async def Prefill(self, request, context):
        return await self.runner.run(request, caller_id(context))

    @grpc_errors
    async def Abort(self, request, context):
        return common_pb2.AbortResponse(found=await self.runner.abort(request.request_id, caller_id(context)))

    @grpc_errors
    async def ModelInfo(self, request, context):
        return model_info(self.runner.loop.engine, self.served_name, request.include_tokenizer)

    @grpc_errors
    async def Load(self, request, context):
        report = load_to_proto(self.runner.loop, num_queued_extra=self.runner.num_inflight)
        report.lora_adapters.extend(self.runner.adapters.states())
        return report
