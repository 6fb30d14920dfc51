"""A signed internal call is bound to the server it was made for and to its request (issue
48, item 6): on real internal servers with the credential interceptor, a credential captured
at one worker is refused at another, the same credential with another request message is
refused, and a call made through the channels the services use goes through."""
from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from support import KeyBook

from pdserve.proto.pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from pdserve.rpc.credentials import InternalAuth, internal_channel
from pdserve.rpc.server import WORKER_MAX_RECEIVE_BYTES, internal_server, service_name
from pdserve.security.credentials import AUDIENCE_HEADER, CREDENTIAL_HEADER, DIGEST_HEADER, request_digest
from pdserve.security.secret import ClusterSecret

METHOD = "/pdserve.v1.Prefill/Prefill"


class Echo(prefill_pb2_grpc.PrefillServicer):
    async def Prefill(self, request, context):
        return prefill_pb2.PrefillResponse(request_id=request.request_id)


async def _serve(secret: ClusterSecret, book: KeyBook) -> tuple[grpc.aio.Server, str]:
    auth = InternalAuth(secret)
    server = internal_server(WORKER_MAX_RECEIVE_BYTES,
                             auth.interceptors([service_name(prefill_pb2, "Prefill")], lambda reason: None, book))
    prefill_pb2_grpc.add_PrefillServicer_to_server(Echo(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    auth.serve_as(address)
    await server.start()
    return server, address


def test_a_credential_is_good_only_at_its_server_for_its_request():
    secret = ClusterSecret(os.urandom(32))
    book = KeyBook(secret)

    async def run() -> None:
        (first, a), (second, b) = await _serve(secret, book), await _serve(secret, book)
        signer = book.signer("decode-0")
        try:
            async with internal_channel(a, signer) as channel:  # as the services call: accepted
                reply = await prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(request_id="ok"))
            assert reply.request_id == "ok"
            request = prefill_pb2.PrefillRequest(request_id="r1")
            captured = [(DIGEST_HEADER, request_digest(request)), (AUDIENCE_HEADER, a),
                        (CREDENTIAL_HEADER, signer.credential(METHOD, a, request_digest(request)))]
            for target, sent, claimed in ((b, request, captured),  # made for a, replayed at b
                                          (b, request, [(k, b if k == AUDIENCE_HEADER else v) for k, v in captured]),
                                          (a, prefill_pb2.PrefillRequest(request_id="r2"), captured)):  # another body
                async with grpc.aio.insecure_channel(target) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await prefill_pb2_grpc.PrefillStub(channel).Prefill(sent, metadata=claimed, timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            unbound = [(CREDENTIAL_HEADER, signer.credential(METHOD))]  # no server, no digest named
            async with grpc.aio.insecure_channel(a) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await prefill_pb2_grpc.PrefillStub(channel).Prefill(request, metadata=unbound, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await first.stop(0)
            await second.stop(0)

    asyncio.run(run())
