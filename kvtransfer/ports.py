"""The surfaces the prefill and decode services use to drive transfers, as typed protocols.

The engine sees the connector only through its two ABC halves (`engine.connector`); the
services see the transfer side through these two, and never through the connector's
internals. The connector's rooms implement them: `PrefillSends` and `DecodeReceives`
(`PdConnector.sends`, `PdConnector.receives`).
"""
from __future__ import annotations

from typing import Protocol, Sequence

from pdserve.kvtransfer.params import TransferParams
from pdserve.kvtransfer.verdict import Fallback, TransferVerdict


class SendControl(Protocol):
    """Prefill side: how each request's send ended, and stopping one that has not started."""

    def wait_verdict(self, request_id: str, timeout_s: float) -> TransferVerdict | None:
        """The verdict of `request_id`'s send (taken: each is read once), or None if none
        came within `timeout_s`. Blocks; call it off the event loop."""

    def unusable(self, params: TransferParams) -> list[Fallback]:
        """[] when some backend could carry this transfer now; else why each cannot (unhealthy
        in its cool-down, not opened here, no receiver endpoint for it)."""

    def connect_ahead(self, params: TransferParams) -> None:
        """A hand-off arrived: start connecting to its receiver's transport endpoints now
        (once per endpoint, in the background), so the first send finds them open. Never
        blocks; a failed connect is left to the send."""

    def abort_send(self, request_id: str) -> bool:
        """The request is being aborted: a send not yet started never will (its verdict
        says aborted); one under way runs to its own deadline. True if one was dropped."""

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish background sends (up to `timeout_s`), close the backends. Idempotent."""


class ReceiveControl(Protocol):
    """Decode side: reserve a request's blocks for one transfer, then settle or drop it."""

    @property
    def block_size(self) -> int:
        """Tokens per KV block of the registered cache."""

    @property
    def endpoints(self) -> dict[str, str]:
        """Backend -> the address its listener bound (transports only)."""

    def prepare_receive(self, request_id: str, block_ids: Sequence[int], num_prompt_tokens: int,
                        num_leading_blocks: int, deadline: float,
                        transfer_id: bytes | None = None) -> TransferParams:
        """Reserve the prompt blocks after the first `num_leading_blocks` until `deadline`
        (time.time()); the hand-off for the prefill service."""

    def complete_receive(self, request_id: str, verdict: TransferVerdict) -> TransferVerdict:
        """Settle with the sender's verdict: ok only if every block is in place, verified."""

    def cancel_receive(self, request_id: str) -> bool:
        """Drop the reservation; later writes are refused. True if one was pending."""

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop listening, close the backends. Idempotent."""
