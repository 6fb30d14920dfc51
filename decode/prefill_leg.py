"""The prefill leg of one disaggregated request, seen from decode.

Decode has allocated the prompt's blocks. It tells its KV receiver to expect a transfer into
the uncached ones, asks the prefill worker to fill them (Prefill RPC with a KVHandoff),
and checks that what the verdict claims really arrived. No wait is unbounded: the RPC has
the hand-off deadline; an abort cancels the RPC and the expected transfer, so no late write
lands in a freed block.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Protocol, Sequence

import grpc

from pdserve.deploy.worker import logprob_from_proto
from pdserve.proto.pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("pdserve.decode.prefill_leg")


class KVReceiver(Protocol):
    """Decode's side of the transfer layer (implemented in kvtransfer)."""

    backends: tuple[str, ...]

    def endpoints(self) -> list[tuple[str, str]]:
        """(backend, address) pairs the prefill worker can write to."""

    def expect(self, transfer_id: bytes, block_ids: Sequence[int], block_hashes: Sequence[int],
               deadline: float) -> None:
        """Reserve `block_ids` for `transfer_id` until `deadline` (time.monotonic)."""

    def complete(self, transfer_id: bytes, backend: str, timeout: float) -> bool:
        """After prefill's verdict: True once every expected block is in place (fetching it
        from the store named by `backend` if it went through one), verified."""

    def abort(self, transfer_id: bytes) -> None:
        """Stop expecting `transfer_id`; later writes for it are refused. Idempotent."""


@dataclass(slots=True)
class LegResult:
    ok: bool
    verdict: common_pb2.TransferVerdict
    first_token_id: int = 0
    first_logprob: object | None = None


class NoReceiver:
    backends: tuple[str, ...] = ()

    def endpoints(self):
        return []

    def expect(self, transfer_id, block_ids, block_hashes, deadline):
        raise RuntimeError("no KV transfer backend is configured")

    def complete(self, transfer_id, backend, timeout):
        return False

    def abort(self, transfer_id):
        pass


class PrefillLeg:
    def __init__(self, receiver: KVReceiver, *, worker_id: str, compat_hash: int,
                 block_size: int, timeout_s: float) -> None:
        self.receiver = receiver
        self.worker_id = worker_id
        self.compat_hash = compat_hash
        self.block_size = block_size
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._inflight: dict[str, tuple[bytes, asyncio.Task]] = {}

    @property
    def can_receive(self) -> bool:
        return bool(self.receiver.endpoints())

    def _stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return prefill_pb2_grpc.PrefillStub(channel)

    async def run(self, request_id: str, prompt_ids: list[int], block_hashes: list[int],
                  sampling: common_pb2.SamplingParams, choice, block_ids: Sequence[int],
                  num_cached_tokens: int) -> LegResult:
        transfer_id = uuid.uuid4().bytes
        verdict = common_pb2.TransferVerdict(prefill_worker_id=choice.worker_id,
                                             transfer_id=transfer_id.hex())
        start = time.monotonic()
        deadline = start + self.timeout_s
        first_block = num_cached_tokens // self.block_size
        dst = list(block_ids[first_block:])
        self.receiver.expect(transfer_id, dst, block_hashes[first_block:], deadline)
        handoff = prefill_pb2.KVHandoff(
            transfer_id=transfer_id.hex(), backends=list(self.receiver.backends),
            endpoints=[prefill_pb2.TransferEndpoint(backend=b, address=a) for b, a in self.receiver.endpoints()],
            block_ids=list(block_ids), num_cached_tokens=num_cached_tokens,
            deadline_unix_ms=int((time.time() + self.timeout_s) * 1000),
            compatibility_hash=self.compat_hash, decode_worker_id=self.worker_id)
        call = self._stub(choice.address).Prefill(
            prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                       block_hashes=block_hashes, sampling=sampling, handoff=handoff),
            timeout=self.timeout_s)
        task = asyncio.ensure_future(call)
        self._inflight[request_id] = (transfer_id, task)
        try:
            resp: prefill_pb2.PrefillResponse = await task
        except grpc.aio.AioRpcError as exc:
            self.receiver.abort(transfer_id)
            verdict.outcome = common_pb2.TRANSFER_OUTCOME_FAILED
            verdict.prefill_status_code = exc.code().name
            verdict.reason = f"prefill_unavailable: {exc.code().name} {exc.details() or ''}".strip()
            verdict.duration_ms = (time.monotonic() - start) * 1000
            return LegResult(False, verdict)
        finally:
            self._inflight.pop(request_id, None)
        verdict.MergeFrom(resp.verdict)
        verdict.prefill_worker_id = choice.worker_id
        if resp.verdict.outcome != common_pb2.TRANSFER_OUTCOME_TRANSFERRED:
            self.receiver.abort(transfer_id)
            verdict.reason = verdict.reason or "transfer_failed"
            return LegResult(False, verdict)
        remaining = max(0.1, deadline - time.monotonic())
        arrived = await asyncio.to_thread(self.receiver.complete, transfer_id, resp.verdict.backend, remaining)
        if not arrived:
            self.receiver.abort(transfer_id)
            verdict.outcome = common_pb2.TRANSFER_OUTCOME_FAILED
            verdict.reason = f"transfer_failed: blocks via {resp.verdict.backend} did not arrive intact"
            return LegResult(False, verdict)
        lp = logprob_from_proto(resp.first_token_logprob) if resp.HasField("first_token_logprob") else None
        verdict.duration_ms = (time.monotonic() - start) * 1000 if not verdict.duration_ms else verdict.duration_ms
        return LegResult(True, verdict, resp.first_token_id, lp)

    async def abort(self, request_id: str) -> None:
        """Cancel the leg of `request_id` if one runs: the RPC, then the expected transfer."""
        entry = self._inflight.pop(request_id, None)
        if entry is None:
            return
        transfer_id, task = entry
        task.cancel()
        self.receiver.abort(transfer_id)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
