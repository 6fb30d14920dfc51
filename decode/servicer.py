"""The Decode gRPC service: convert, delegate to `DecodeSessions`, convert back. Errors are
mapped by `rpc.errors.grpc_errors` from the one table."""
from __future__ import annotations

from pdserve.decode.session import DecodeSessions, keep_alive
from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from pdserve.worker.convert import load_to_proto, model_info
from pdserve.rpc.errors import grpc_errors


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(self, sessions: DecodeSessions, served_name: str) -> None:
        self.sessions = sessions
        self.served_name = served_name

    @grpc_errors
    async def Decode(self, request, context):
        responses = self.sessions.run(request)
        if request.keepalive_ms:
            responses = keep_alive(responses, request.keepalive_ms / 1000,
                                   lambda: decode_pb2.DecodeResponse(request_id=request.request_id))
        async for response in responses:
            yield response

    @grpc_errors
    async def Abort(self, request, context):
        return common_pb2.AbortResponse(found=await self.sessions.abort(request.request_id))

    @grpc_errors
    async def ModelInfo(self, request, context):
        return model_info(self.sessions.loop.engine, self.served_name, request.include_tokenizer)

    @grpc_errors
    async def Load(self, request, context):
        report = load_to_proto(self.sessions.loop)
        report.lora_adapters.extend(self.sessions.adapters.states())
        return report
