"""The one error table: typed errors -> HTTP status, gRPC code, OpenAI JSON; every servicer
speaks it through `grpc_errors`, over a real gRPC server."""
from __future__ import annotations


import grpc
import pytest

from pdserve.common import errors
from pdserve.common.errors import ErrorKind, ServiceError, to_service_error, wire
from pdserve.proto.pdserve.v1 import common_pb2, prefill_pb2_grpc
from pdserve.rpc.errors import grpc_errors


def test_error_table_speaks_grpc_http_and_openai():
    err = ServiceError(ErrorKind.INVALID_ARGUMENT, "temperature must be in [0, 2]", param="temperature")
    assert (grpc.StatusCode[err.grpc_code], err.http_status) == (grpc.StatusCode.INVALID_ARGUMENT, 400)
    assert err.openai_body() == {"error": {"message": "temperature must be in [0, 2]", "type": "invalid_request_error",
                                           "param": "temperature", "code": None}}
    limited = ServiceError(ErrorKind.RATE_LIMITED, "busy", retry_after_s=2)
    assert (limited.http_status, limited.http_headers()) == (429, {"Retry-After": "2"})
    assert wire(ErrorKind.NOT_FOUND).http_status == 404 and wire(ErrorKind.UNAVAILABLE).http_status == 503
    assert wire(ErrorKind.PAYLOAD_TOO_LARGE).http_status == 413
    for kind in ErrorKind:  # every kind is mapped, to a real status code
        assert wire(kind).http_status >= 400
        assert grpc.StatusCode[wire(kind).grpc_code] is not grpc.StatusCode.OK
    # What a worker sends comes back as the same kind, field and retry delay.
    back = ServiceError.from_grpc(err.grpc_code, err.message, err.grpc_trailing_metadata())
    assert (back.kind, back.param) == (ErrorKind.INVALID_ARGUMENT, "temperature")
    back = ServiceError.from_grpc(limited.grpc_code, "busy", limited.grpc_trailing_metadata())
    assert (back.kind, back.retry_after_s) == (ErrorKind.RATE_LIMITED, 2)
    assert ServiceError.from_grpc("DATA_LOSS", "").kind is ErrorKind.INTERNAL


@pytest.mark.parametrize("exc, kind, code", [
    (errors.PromptTooLongError("long"), ErrorKind.INVALID_ARGUMENT, "context_length_exceeded"),
    (errors.InvalidRequestError("bad"), ErrorKind.INVALID_ARGUMENT, None),
    (errors.CapacityError("never fits"), ErrorKind.INVALID_ARGUMENT, "kv_capacity_exceeded"),
    (errors.OverloadedError("full"), ErrorKind.RATE_LIMITED, None),
    (errors.IncompatiblePeerError("other model"), ErrorKind.FAILED_PRECONDITION, None),
    (errors.RequestAbortedError("gone"), ErrorKind.CANCELLED, None),
    (errors.TransferError("refused"), ErrorKind.UNAVAILABLE, None),
    (errors.DeadlinePassedError("late"), ErrorKind.DEADLINE_EXCEEDED, None),
    (TimeoutError(), ErrorKind.DEADLINE_EXCEEDED, None),
    (errors.UpstreamFailedError("prefill failed"), ErrorKind.UPSTREAM_FAILED, None),
])
def test_typed_errors_map_to_their_kinds(exc, kind, code):
    err = to_service_error(exc)
    assert err.kind is kind
    assert err.openai_body()["error"]["code"] == (code or wire(kind).openai_code)


def test_unexpected_errors_are_internal_without_their_text():
    err = to_service_error(KeyError("/secret/path"))
    assert err.kind is ErrorKind.INTERNAL and "secret" not in err.message


class _Failing(prefill_pb2_grpc.PrefillServicer):
    """Each RPC raises what the test put in `raise_next`."""

    def __init__(self) -> None:
        self.raise_next: BaseException = RuntimeError("boom")

    @grpc_errors
    async def Abort(self, request, context):
        raise self.raise_next


async def test_servicer_errors_leave_with_the_table_code_over_grpc():
    server = grpc.aio.server()
    servicer = _Failing()
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = prefill_pb2_grpc.PrefillStub(channel)
            for exc, code in ((errors.OverloadedError("prefill queue is full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
                              (errors.IncompatiblePeerError("hash"), grpc.StatusCode.FAILED_PRECONDITION),
                              (ServiceError(ErrorKind.INVALID_ARGUMENT, "bad", param="x"), grpc.StatusCode.INVALID_ARGUMENT),
                              (ValueError("/internal/detail"), grpc.StatusCode.INTERNAL)):
                servicer.raise_next = exc
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Abort(common_pb2.AbortRequest(request_id="r"), timeout=10)
                assert info.value.code() is code
                assert "/internal/detail" not in (info.value.details() or "")
                back = to_service_error(info.value)  # the caller's side reads the same kind back
                assert back.kind is to_service_error(exc).kind
    finally:
        await server.stop(None)


def test_every_rpc_goes_through_the_table():
    from pdserve.decode.servicer import DecodeService
    from pdserve.prefill.servicer import PrefillService
    from pdserve.proto.pdserve.v1 import decode_pb2, generation_pb2, prefill_pb2, registry_pb2
    from pdserve.router.grpc_api import GenerationServicer, RegistryServicer

    for cls, pb2, name in ((DecodeService, decode_pb2, "Decode"), (PrefillService, prefill_pb2, "Prefill"),
                           (GenerationServicer, generation_pb2, "Generation"),
                           (RegistryServicer, registry_pb2, "Registry")):
        for method in pb2.DESCRIPTOR.services_by_name[name].methods:
            fn = getattr(cls, method.name)
            assert getattr(fn, "__wrapped__", None) is not None, (cls.__name__, method.name)
