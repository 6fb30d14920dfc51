"""The transfer layer at the services' edge: the one place protos meet it.

Converts between the proto hand-off and verdict (KVHandoff, TransferVerdict) and the
connector's typed objects (TransferParams, kvtransfer.verdict.TransferVerdict), signs and
checks hand-offs (`security.handoffs` keeps the rule; this only fills its claim from the
proto), and gives the decode the addresses a sender reaches its receives at
(`AdvertisedReceives`, a `ReceiveControl` like the connector's own). Each process converts a
verdict once, at its edge: a transfer's (did the KV land) as the prefill's answer, the
request's (what the decode did about it) on the decode's stream.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from pdserve.kvtransfer.config import STORES
from pdserve.kvtransfer.connector import connector_factory
from pdserve.kvtransfer.params import TransferParams
from pdserve.kvtransfer.ports import ReceiveControl
from pdserve.kvtransfer.verdict import (RECOMPUTE, Fallback, Landing, Outcome, RequestVerdict, TransferVerdict,
                                        failure_reason)
from pdserve.proto.pdserve.v1 import common_pb2, prefill_pb2
from pdserve.security import handoffs
from pdserve.security.handoffs import HandoffClaim
from pdserve.security.secret import ClusterSecret, Mac

_OUTCOMES = {
    Outcome.TRANSFERRED: common_pb2.TRANSFER_OUTCOME_TRANSFERRED,
    Outcome.RECOMPUTED: common_pb2.TRANSFER_OUTCOME_RECOMPUTED,
    Outcome.FAILED: common_pb2.TRANSFER_OUTCOME_FAILED,
    Outcome.ABORTED: common_pb2.TRANSFER_OUTCOME_ABORTED,
    Outcome.LOCAL: common_pb2.TRANSFER_OUTCOME_LOCAL,
}
# a transfer's verdict on the wire: its KV landed, was aborted, or (anything else) is missing
_LANDINGS = {
    Landing.LANDED: common_pb2.TRANSFER_OUTCOME_TRANSFERRED,
    Landing.MISSING: common_pb2.TRANSFER_OUTCOME_FAILED,
    Landing.ABORTED: common_pb2.TRANSFER_OUTCOME_ABORTED,
}
_FROM_PROTO = {common_pb2.TRANSFER_OUTCOME_TRANSFERRED: Landing.LANDED,
               common_pb2.TRANSFER_OUTCOME_ABORTED: Landing.ABORTED}


def verdict_to_proto(v: TransferVerdict) -> common_pb2.TransferVerdict:
    """A transfer's verdict as it leaves this process (once: the prefill's answer)."""
    reason = v.reason or (failure_reason(v) if v.landing == Landing.MISSING else "")
    return _to_proto(v, _LANDINGS[v.landing], v.backend, reason)


def request_verdict_to_proto(r: RequestVerdict) -> common_pb2.TransferVerdict:
    """The request's verdict as it leaves this process (once: the decode's stream)."""
    missing = r.outcome in (Outcome.RECOMPUTED, Outcome.FAILED)
    reason = r.reason or (failure_reason(r.transfer) if missing else "")
    return _to_proto(r.transfer, _OUTCOMES[r.outcome], "" if r.backend == RECOMPUTE else r.backend, reason)


def _to_proto(v: TransferVerdict, outcome: int, backend: str, reason: str) -> common_pb2.TransferVerdict:
    return common_pb2.TransferVerdict(
        outcome=outcome, backend=backend,
        num_bytes=v.num_bytes, num_blocks=v.num_blocks, duration_ms=v.duration_s * 1000,
        transfer_id=v.transfer_id, fetch_keys=list(v.fetch_keys), num_messages=v.num_messages,
        layer_send_ms=v.layer_send_s * 1000, reason=reason, prefill_worker_id=v.peer,
        prefill_status_code=v.peer_status,
        fallbacks=[common_pb2.FallbackStep(backend=f.backend, reason=f.reason,
                                           duration_ms=f.duration_s * 1000) for f in v.fallbacks])


def verdict_from_proto(p: common_pb2.TransferVerdict) -> TransferVerdict:
    """A peer's transfer verdict as it enters this process (once)."""
    return TransferVerdict(p.transfer_id, _FROM_PROTO.get(p.outcome, Landing.MISSING), p.backend, p.num_blocks,
                           p.num_bytes, p.duration_ms / 1000,
                           tuple(Fallback(f.backend, f.reason, f.duration_ms / 1000) for f in p.fallbacks),
                           tuple(p.fetch_keys), num_messages=p.num_messages, layer_send_s=p.layer_send_ms / 1000,
                           reason=p.reason, peer=p.prefill_worker_id, peer_status=p.prefill_status_code)


def params_to_handoff(tp: TransferParams, block_ids: Sequence[int], block_size: int,
                      decode_worker_id: str) -> prefill_pb2.KVHandoff:
    return prefill_pb2.KVHandoff(
        transfer_id=tp.transfer_id.hex(), backends=list(tp.backends),
        endpoints=[prefill_pb2.TransferEndpoint(backend=b, address=a) for b, a in tp.endpoints],
        block_ids=list(block_ids), num_cached_tokens=tp.num_leading_blocks * block_size,
        deadline_unix_ms=int(tp.deadline * 1000), compatibility_hash=tp.compat_hash,
        decode_worker_id=decode_worker_id)


def handoff_claim(request: prefill_pb2.PrefillRequest) -> HandoffClaim:
    """What the decode's signature on the request's hand-off covers (`security.handoffs`)."""
    h = request.handoff
    return HandoffClaim(
        h.transfer_id, h.backends, [(e.backend, e.address) for e in h.endpoints], h.block_ids,
        h.num_cached_tokens, h.deadline_unix_ms, h.compatibility_hash, h.decode_worker_id,
        request.request_id, request.prompt_token_ids, request.block_hashes,
        request.sampling.SerializeToString(deterministic=True), request.cache_salt,
        (h.lora_name, h.lora_digest))


def sign_handoff(request: prefill_pb2.PrefillRequest, mac: Mac) -> None:
    request.handoff.signature = handoffs.sign(mac, handoff_claim(request))


def check_handoff_signature(request: prefill_pb2.PrefillRequest, mac: Mac) -> None:
    """AuthError unless the decode's signature on the request's hand-off holds."""
    handoffs.check_signature(mac, handoff_claim(request), request.handoff.signature)


def handoff_to_params(h: prefill_pb2.KVHandoff, block_size: int) -> TransferParams:
    """Bounds-checked: the handoff comes from a peer."""
    from pdserve.common.errors import InvalidRequestError

    if h.num_cached_tokens % block_size:
        raise InvalidRequestError("num_cached_tokens must be a multiple of the block size")
    leading = h.num_cached_tokens // block_size
    if leading > len(h.block_ids):
        raise InvalidRequestError("num_cached_tokens covers more blocks than block_ids names")
    try:
        transfer_id = bytes.fromhex(h.transfer_id)
    except ValueError:
        raise InvalidRequestError("transfer_id must be hex") from None
    return TransferParams(transfer_id, tuple(h.block_ids[leading:]), leading,
                          h.deadline_unix_ms / 1000, h.compatibility_hash,
                          tuple((e.backend, e.address) for e in h.endpoints), tuple(h.backends))


class AdvertisedReceives:
    """The decode's `ReceiveControl`: the connector's receives, with the endpoints a sender can
    reach (a transport's listener, a wildcard bind advertised as --advertise-host; a store's
    `KVTransferConfig.store_endpoint`), in chain order, in every hand-off it prepares."""

    def __init__(self, receives: ReceiveControl, settings) -> None:
        self.receives = receives
        self.settings = settings
        self.backends = settings.transfer_config().backends

    @property
    def endpoints(self) -> dict[str, str]:
        advertise = self.settings.advertise_host
        listening = self.receives.endpoints
        config = self.settings.transfer_config()
        out = {}
        for backend in self.backends:
            address = listening.get(backend) or (config.store_endpoint(backend) if backend in STORES else "")
            if not address:
                continue
            host, sep, port = address.rpartition(":")
            if backend in listening and sep and advertise and host in ("0.0.0.0", "::", "[::]"):
                address = f"{advertise}:{port}"
            out[backend] = address
        return out

    def prepare_receive(self, request_id: str, block_ids: Sequence[int], num_prompt_tokens: int,
                        num_leading_blocks: int, deadline: float, transfer_id: bytes | None = None,
                        block_hashes: Sequence[int] | None = None) -> TransferParams:
        tp = self.receives.prepare_receive(request_id, block_ids, num_prompt_tokens, num_leading_blocks, deadline,
                                           transfer_id, block_hashes)
        # advertise reachable endpoints (a 0.0.0.0 listener is not an address)
        return dataclasses.replace(tp, endpoints=tuple(self.endpoints.items()))

    def complete_receive(self, request_id: str, verdict: TransferVerdict) -> TransferVerdict:
        return self.receives.complete_receive(request_id, verdict)

    def cancel_receive(self, request_id: str) -> bool:
        return self.receives.cancel_receive(request_id)


def make_connector(settings, secret: ClusterSecret | None = None, *, listen: bool):
    """The factory the engine builds its connector with: the transfer layer of `settings`,
    its keys from `secret`. `listen`: open the transports' receivers (a decode)."""
    return connector_factory(settings.transfer_config(secret), listen=listen)
