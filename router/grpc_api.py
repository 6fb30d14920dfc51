"""gRPC edge of the router: the Generation and Registry servicers. Each RPC converts,
delegates and converts back; errors leave through `@grpc_errors` (the one mapping table)."""
from __future__ import annotations

import logging

from pdserve.common.errors import EXPECTED_ERRORS, AuthError, InvalidRequestError
from pdserve.rpc.credentials import caller_id
from pdserve.rpc.errors import grpc_errors
from pdserve.proto.pdserve.v1 import (common_pb2, generation_pb2_grpc, registry_pb2,
                                      registry_pb2_grpc)
from pdserve.router import fanout
from pdserve.router.api_key import ApiKeyCheck
from pdserve.router.catalog import ModelCatalog
from pdserve.router.config import RouterConfig
from pdserve.router.frontend import Frontend
from pdserve.router.membership import Membership, load_from_proto, worker_from_proto
from pdserve.router.tools import apply_tools, grpc_tool_calls

log = logging.getLogger("pdserve.router.grpc")


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend, catalog: ModelCatalog, auth: ApiKeyCheck) -> None:
        self._frontend = frontend
        self._catalog = catalog
        self._auth = auth

    @grpc_errors
    async def Generate(self, request, context):
        try:
            self._auth.check_grpc(context)
            tool_mode = apply_tools(request)
        except EXPECTED_ERRORS as err:
            self._frontend.count_rejected("grpc", err)
            raise
        if request.n > 1 or request.best_of > 1:  # several choices, each its own generation
            stream = fanout.grpc_stream(request, lambda one: self._frontend.generate(one, api="grpc"))
        else:
            stream = self._frontend.generate(request, api="grpc")
        texts: dict[int, list[str]] = {}  # with tools: each choice's text, read as a call at its end
        async for response in stream:
            if tool_mode.mode:
                texts.setdefault(response.index, []).append(response.text)
                if response.finish_reason:
                    response.tool_calls.extend(grpc_tool_calls("".join(texts[response.index]), tool_mode))
            yield response

    @grpc_errors
    async def Abort(self, request, context):
        self._auth.check_grpc(context)
        found = await self._frontend.abort(request.request_id, request.reason or "client_abort")
        return common_pb2.AbortResponse(found=found)

    @grpc_errors
    async def ModelInfo(self, request, context):
        self._auth.check_grpc(context)
        response = common_pb2.ModelInfoResponse()
        response.CopyFrom(self._catalog.resolve(request.model).info)
        if not request.include_tokenizer:
            response.ClearField("tokenizer_json")
        response.ClearField("block_hash_salt")  # internal: clients have no use for block hashes
        return response


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    """A registration is bound to its lease: only the process that registered a worker id
    may heartbeat or deregister it, or register it again while it is alive. With
    `authenticated`, a worker id is also bound to the credential that names it."""

    def __init__(self, membership: Membership, config: RouterConfig, *, authenticated: bool = False) -> None:
        self._membership = membership
        self._authenticated = authenticated
        self._interval_ms = int(config.heartbeat_interval_s * 1000)
        self._timeout_ms = int(config.worker_timeout_s * 1000)

    def _check_caller(self, context, worker_id: str) -> None:
        if self._authenticated and caller_id(context) != worker_id:
            raise AuthError(f"a credential of {caller_id(context)!r} cannot act for worker {worker_id!r}")

    @grpc_errors
    async def Register(self, request, context):
        self._check_caller(context, request.worker.worker_id)
        try:
            worker = worker_from_proto(request.worker)
            lease = await self._membership.register(worker, load_from_proto(request.load),
                                                    request.load.cached_block_hashes, request.lease)
        except Exception as exc:  # logged, then re-raised
            log.warning("register of %r refused: %s", request.worker.worker_id, exc)
            raise
        return registry_pb2.RegisterResponse(heartbeat_interval_ms=self._interval_ms,
                                             worker_timeout_ms=self._timeout_ms, lease=lease)

    @grpc_errors
    async def Heartbeat(self, request, context):
        self._check_caller(context, request.worker_id)
        self._membership.heartbeat(request.worker_id, load_from_proto(request.load),
                                   request.load.cached_block_hashes, request.lease)
        return registry_pb2.HeartbeatResponse(heartbeat_interval_ms=self._interval_ms)

    @grpc_errors
    async def Deregister(self, request, context):
        if not request.worker_id:
            raise InvalidRequestError("worker_id is required", param="worker_id")
        self._check_caller(context, request.worker_id)
        return registry_pb2.DeregisterResponse(found=self._membership.deregister(request.worker_id, request.lease))
