"""The transfer layer at the services' edge: the one place protos meet it.

Converts between the proto hand-off and verdict (KVHandoff, TransferVerdict) and the
connector's typed objects (TransferParams, kvtransfer.verdict.TransferVerdict), signs and
checks hand-offs (`security.handoffs` keeps the rule; this only fills its claim from the
proto), and gives each role its facade over the engine's connector: `Sender` (prefill) and
`Receiver` (decode). Each process converts a verdict once, at its edge.
"""
from __future__ import annotations

import asyncio
import time
from typing import Sequence

from pdserve.kvtransfer.config import STORES
from pdserve.kvtransfer.connector import PdConnector, connector_factory
from pdserve.kvtransfer.params import TransferParams
from pdserve.kvtransfer.ports import ReceiveControl, SendControl
from pdserve.kvtransfer.verdict import Fallback, Outcome, TransferVerdict, failure_reason
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
_FROM_PROTO = {wire: outcome for outcome, wire in _OUTCOMES.items()}  # anything else: FAILED


def verdict_to_proto(v: TransferVerdict) -> common_pb2.TransferVerdict:
    """The verdict as it leaves this process (once: prefill's answer, decode's stream)."""
    out = common_pb2.TransferVerdict(
        outcome=_OUTCOMES[v.outcome], backend=v.backend if v.backend != "recompute" else "",
        num_bytes=v.num_bytes, num_blocks=v.num_blocks, duration_ms=v.duration_s * 1000,
        transfer_id=v.transfer_id, fetch_keys=list(v.fetch_keys), num_messages=v.num_messages,
        layer_send_ms=v.layer_send_s * 1000, reason=v.reason, prefill_worker_id=v.peer,
        prefill_status_code=v.peer_status,
        fallbacks=[common_pb2.FallbackStep(backend=f.backend, reason=f.reason,
                                           duration_ms=f.duration_s * 1000) for f in v.fallbacks])
    if not v.reason and v.outcome in (Outcome.RECOMPUTED, Outcome.FAILED):
        out.reason = failure_reason(v)
    return out


def verdict_from_proto(p: common_pb2.TransferVerdict) -> TransferVerdict:
    """A peer's verdict as it enters this process (once)."""
    return TransferVerdict(p.transfer_id, _FROM_PROTO.get(p.outcome, Outcome.FAILED), p.backend, p.num_blocks,
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
        request.sampling.SerializeToString(deterministic=True), request.cache_salt)


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


class Sender:
    """Prefill's side: the sends room of the engine's connector, and the hand-offs it takes."""

    def __init__(self, connector: PdConnector, block_size: int) -> None:
        self.connector = connector
        self.block_size = block_size
        self.sends: SendControl = connector.sends

    def transfer_params(self, request_id: str, handoff: prefill_pb2.KVHandoff) -> TransferParams:
        params = handoff_to_params(handoff, self.block_size)
        self.sends.connect_ahead(params)  # first contact: connect while the prompt computes
        return params

    def refusal(self, handoff: prefill_pb2.KVHandoff) -> common_pb2.TransferVerdict | None:
        """None when some backend could carry this hand-off now; else the verdict (FAILED,
        reason no_usable_kv_backend, a fallback per backend) that spares computing the prompt
        only to throw its KV away."""
        skipped = self.sends.unusable(handoff_to_params(handoff, self.block_size))
        if not skipped:
            return None
        why = "no_usable_kv_backend: " + "; ".join(f"{f.backend}: {f.reason}" for f in skipped)
        return verdict_to_proto(TransferVerdict(handoff.transfer_id, Outcome.FAILED, "", fallbacks=tuple(skipped),
                                                reason=why))

    async def verdict(self, request_id: str, timeout: float) -> tuple[common_pb2.TransferVerdict, float]:
        """(the send's verdict, its tail in ms: end of the prompt's forward to the verdict)."""
        v = await asyncio.to_thread(self.sends.wait_verdict, request_id, timeout)
        if v is None:
            v = TransferVerdict("", Outcome.FAILED, "", reason="transfer_failed: no verdict before the deadline")
        return verdict_to_proto(v), v.tail_s * 1000

    def abort(self, request_id: str) -> None:
        self.sends.abort_send(request_id)

    def close(self) -> None:
        self.connector.worker.close()


class Receiver:
    """Decode's side: reserve blocks for a transfer, settle it with prefill's verdict."""

    def __init__(self, connector: PdConnector, settings) -> None:
        self.connector = connector
        self.receives: ReceiveControl = connector.receives
        self.settings = settings
        self.backends = settings.transfer_config().backends

    def endpoints(self) -> list[tuple[str, str]]:
        """Where each configured backend reaches us, in chain order: a transport's listener
        (a wildcard bind is advertised as --advertise-host), a store's
        `KVTransferConfig.store_endpoint`."""
        advertise = self.settings.advertise_host
        listening = self.receives.endpoints
        config = self.settings.transfer_config()
        out = []
        for backend in self.backends:
            address = listening.get(backend) or (config.store_endpoint(backend) if backend in STORES else "")
            if not address:
                continue
            host, sep, port = address.rpartition(":")
            if backend in listening and sep and advertise and host in ("0.0.0.0", "::", "[::]"):
                address = f"{advertise}:{port}"
            out.append((backend, address))
        return out

    def prepare(self, request_id: str, block_ids: Sequence[int], num_prompt_tokens: int,
                num_cached_tokens: int, timeout_s: float, block_hashes: Sequence[int] | None = None) -> TransferParams:
        bs = self.receives.block_size
        tp = self.receives.prepare_receive(request_id, block_ids, num_prompt_tokens,
                                         num_cached_tokens // bs, time.time() + timeout_s,
                                         block_hashes=block_hashes)
        # advertise reachable endpoints (a 0.0.0.0 listener is not an address)
        import dataclasses

        return dataclasses.replace(tp, endpoints=tuple(self.endpoints()))

    def complete(self, request_id: str, verdict: TransferVerdict) -> TransferVerdict:
        """Settle with the prefill's verdict (fetching from a store if one carried the
        blocks): ok only if every block is in place and verified."""
        return self.receives.complete_receive(request_id, verdict)

    def cancel(self, request_id: str) -> None:
        self.receives.cancel_receive(request_id)

    def close(self) -> None:
        self.connector.worker.close()


def make_connector(settings, secret: ClusterSecret | None = None, *, listen: bool):
    """The factory the engine builds its connector with: the transfer layer of `settings`,
    its keys from `secret`. `listen`: open the transports' receivers (a decode)."""
    return connector_factory(settings.transfer_config(secret), listen=listen)
