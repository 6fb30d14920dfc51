"""gRPC edge of the router: the Generation and Registry servicers. Each RPC converts,
delegates and converts back; errors leave through `@grpc_errors` (the one mapping table)."""
from __future__ import annotations

import logging

from pdserve.common.errors import EXPECTED_ERRORS, InvalidRequestError
from pdserve.rpc.credentials import caller_id, certificate_addresses
from pdserve.rpc.errors import grpc_errors
from pdserve.proto.pdserve.v1 import (common_pb2, generation_pb2_grpc, kv_events_pb2, registry_pb2,
                                      registry_pb2_grpc)
from pdserve.router import fanout
from pdserve.router.catalog import ModelCatalog
from pdserve.router.config import RouterConfig
from pdserve.router.frontend import Frontend
from pdserve.router.kv_index import KVEventIntake
from pdserve.router.membership import Membership, load_from_proto, worker_from_proto
from pdserve.router.request_ids import check_label
from pdserve.router.tools import apply_tools, grpc_tool_calls
from pdserve.security.client_keys import ClientKeys
from pdserve.security.enrollment import ENROLLMENT_HEADER, EnrollmentVerifier
from pdserve.security.internal_tls import check_registered_address
from pdserve.security.registration import check_acts_for

log = logging.getLogger("pdserve.router.grpc")


def caller_of(context) -> str:
    """Who made a client call, for Abort: its HTTP/2 connection (the peer's address and
    port). Every client holds the same API key, so the key tells no two clients apart; a
    connection is one client's alone. Channels of one process may share a connection (grpc's
    subchannel pool), and a proxy that pools connections is one caller for all it carries."""
    return f"grpc {context.peer()}"


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """The client API. Every call has passed `ApiKeyInterceptor` before any of these runs.
    A client's request_id is a label (`request_ids`): the router assigns the id services act
    on; Abort stops only a request of the same caller (`caller_of`). Generate's responses
    carry routing, transfer and timings only for the admin key (`Scope`)."""

    def __init__(self, frontend: Frontend, catalog: ModelCatalog, auth: ClientKeys) -> None:
        self._frontend = frontend
        self._catalog = catalog
        self._auth = auth

    @grpc_errors
    async def Generate(self, request, context):
        try:
            check_label(request.request_id)
            tool_mode = apply_tools(request)
        except EXPECTED_ERRORS as err:
            self._frontend.count_rejected("grpc", err)
            raise
        caller = caller_of(context)
        who = self._auth.identify_metadata(context.invocation_metadata())

        def generate(one):  # a choice's label is request_id-k (fanout)
            return self._frontend.generate(one, api="grpc", owner=caller, label=one.request_id, scope=who.scope,
                                           tenant=who.tenant)

        if request.n > 1 or request.best_of > 1:  # several choices, each its own generation
            stream = fanout.grpc_stream(request, generate)
        else:
            stream = generate(request)
        texts: dict[int, list[str]] = {}  # with tools: each choice's text, read as a call at its end
        async for response in stream:
            if tool_mode.mode:
                texts.setdefault(response.index, []).append(response.text)
                if response.finish_reason:
                    response.tool_calls.extend(grpc_tool_calls("".join(texts[response.index]), tool_mode))
            yield response

    @grpc_errors
    async def Abort(self, request, context):
        found = await self._frontend.abort(caller_of(context), request.request_id, request.reason)
        return common_pb2.AbortResponse(found=found)

    @grpc_errors
    async def ModelInfo(self, request, context):
        response = common_pb2.ModelInfoResponse()
        response.CopyFrom(self._frontend.resolve(request.model)[0].info)  # an adapter: its base model's
        if not request.include_tokenizer:
            response.ClearField("tokenizer_json")
        response.ClearField("block_hash_salt")  # internal: clients have no use for block hashes
        return response


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    """A registration is bound to its lease: only the process that registered a worker id
    may heartbeat or deregister it, or register it again while it is alive. With
    `authenticated`, a worker id is also bound to the credential that names it and to the
    public key it registered (which its later calls are signed with); `public_key` is the
    router's own, sent back in RegisterResponse."""

    def __init__(self, membership: Membership, config: RouterConfig, kv_events: KVEventIntake, *,
                 authenticated: bool = False, public_key: bytes = b"",
                 enrollment: EnrollmentVerifier | None = None) -> None:
        """`enrollment`: when set, a Register needs its worker's own enrollment token."""
        self._kv_events = kv_events
        self._membership = membership
        self._enrollment = enrollment
        self._authenticated = authenticated
        self._public_key = public_key
        self._interval_ms = int(config.heartbeat_interval_s * 1000)
        self._timeout_ms = int(config.worker_timeout_s * 1000)

    def _check_caller(self, context, worker_id: str) -> None:
        if self._authenticated:
            check_acts_for(caller_id(context), worker_id)

    @grpc_errors
    async def Register(self, request, context):
        self._check_caller(context, request.worker.worker_id)
        try:
            worker = worker_from_proto(request.worker)
            check_registered_address(certificate_addresses(context), worker.address)
            if self._enrollment is not None:
                found = [v for k, v in context.invocation_metadata() or () if k == ENROLLMENT_HEADER]
                self._enrollment.check(found[0] if len(found) == 1 else None, worker.worker_id, worker.role.value,
                                       worker.address)
            lease = await self._membership.register(worker, load_from_proto(request.load), request.lease,
                                                    request.public_key, require_key=self._authenticated)
        except Exception as exc:  # logged, then re-raised
            log.warning("register of %r refused: %s", request.worker.worker_id, exc)
            raise
        return registry_pb2.RegisterResponse(heartbeat_interval_ms=self._interval_ms,
                                             worker_timeout_ms=self._timeout_ms, lease=lease,
                                             router_public_key=self._public_key)

    @grpc_errors
    async def Heartbeat(self, request, context):
        self._check_caller(context, request.worker_id)
        self._membership.heartbeat(request.worker_id, load_from_proto(request.load), request.lease)
        return registry_pb2.HeartbeatResponse(heartbeat_interval_ms=self._interval_ms)

    @grpc_errors
    async def Deregister(self, request, context):
        if not request.worker_id:
            raise InvalidRequestError("worker_id is required", param="worker_id")
        self._check_caller(context, request.worker_id)
        return registry_pb2.DeregisterResponse(found=self._membership.deregister(request.worker_id, request.lease))

    @grpc_errors
    async def Lookup(self, request, context):
        return self._membership.lookup(request.worker_id)

    @grpc_errors
    async def PublishKVEvents(self, request, context):
        """Only the registered worker itself: its credential and its registration's lease."""
        self._check_caller(context, request.worker_id)
        self._membership.check_lease(request.worker_id, request.lease)
        return kv_events_pb2.KVEventAck(in_order=self._kv_events.receive(request))
