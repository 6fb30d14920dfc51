"""The one contract per direction between the services and the transfer layer.

The engine sees the connector only through its two ABC halves (`engine.connector`); the
prefill and decode services see the transfer side only through these two protocols, under
the same method names at every hop:

* `SendControl` (prefill): implemented by the connector's `ServiceSends`
  (`PdConnector.sends`); the prefill runner calls it directly.
* `ReceiveControl` (decode): implemented by the connector's `DecodeReceives`
  (`PdConnector.receives`), by `worker.transfer.AdvertisedReceives` (the same, with the
  addresses a peer can reach) and by `NoReceives` (no backend configured).

Both speak typed objects (`TransferParams`, `TransferVerdict`); the proto forms are made at
the services' edge (`worker.transfer`). A verdict here says only whether the KV landed; the
request's outcome is decided by the decode (`verdict.decide`). Who closes the connector is
its owner (the service's shutdown closes `PdConnector.worker`), not a caller of these.
`tests/unit/test_transfer_ports.py` holds every implementation to its protocol's signatures.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from pdserve.kvtransfer.params import TransferParams
from pdserve.kvtransfer.verdict import Fallback, TransferVerdict


class SendControl(Protocol):
    """Prefill side, on any service thread: prepare a hand-off's send, learn how it ended,
    stop one that has not started."""

    def connect_ahead(self, params: TransferParams) -> None:
        """A hand-off arrived: start connecting to its receiver's transport endpoints now
        (once per endpoint, in the background), so the first send finds them open. Never
        blocks; a failed connect is left to the send."""

    def unusable(self, params: TransferParams) -> list[Fallback]:
        """[] when some backend could carry this transfer now; else why each cannot (unhealthy
        in its cool-down, not opened here, no receiver endpoint for it)."""

    def wait_verdict(self, request_id: str, timeout_s: float) -> TransferVerdict | None:
        """The verdict of `request_id`'s send (taken: each is read once), or None if none
        came within `timeout_s`. Blocks; call it off the event loop."""

    def abort_send(self, request_id: str) -> bool:
        """The request is being aborted: a send not yet started never will (its verdict
        says aborted); one under way runs to its own deadline. True if one was dropped."""


class ReceiveControl(Protocol):
    """Decode side, on any service thread: reserve a request's blocks for one transfer, then
    settle or drop it."""

    @property
    def endpoints(self) -> dict[str, str]:
        """Backend -> the address a sender reaches it at, in chain order ({}: none)."""

    def prepare_receive(self, request_id: str, block_ids: Sequence[int], num_prompt_tokens: int,
                        num_leading_blocks: int, deadline: float, transfer_id: bytes | None = None,
                        block_hashes: Sequence[int] | None = None) -> TransferParams:
        """Reserve the prompt blocks after the first `num_leading_blocks` until `deadline`
        (time.time()); the hand-off for the prefill service. With `block_hashes` (ours, of
        the prompt's full blocks) a block arriving under any other hash is refused."""

    def complete_receive(self, request_id: str, verdict: TransferVerdict) -> TransferVerdict:
        """Settle with the sender's verdict (fetching from a store if one carried the
        blocks): landed only if every block is in place and verified."""

    def cancel_receive(self, request_id: str) -> bool:
        """Drop the reservation; later writes are refused. True if one was pending."""


class NoReceives:
    """`ReceiveControl` of a decode with no KV backend: it prefills every prompt itself."""

    @property
    def endpoints(self) -> dict[str, str]:
        return {}

    def prepare_receive(self, request_id: str, block_ids: Sequence[int], num_prompt_tokens: int,
                        num_leading_blocks: int, deadline: float, transfer_id: bytes | None = None,
                        block_hashes: Sequence[int] | None = None) -> TransferParams:
        raise RuntimeError("no KV transfer backend is configured")

    def complete_receive(self, request_id: str, verdict: TransferVerdict) -> TransferVerdict:
        return verdict

    def cancel_receive(self, request_id: str) -> bool:
        return False
