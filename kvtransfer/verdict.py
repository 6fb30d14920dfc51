"""The transfer verdict: what happened to one request's KV, for the caller to see and log.

Every transfer ends in exactly one verdict, whichever way it ends. A fallback is never
silent: each backend that was tried (or skipped) before the one that answered is listed with
its reason. Senders and the receiver's settlement say only whether the KV landed
(TRANSFERRED, else FAILED, or ABORTED); what the request does about KV that did not land is
decided once, by `decide` under the decode's failure policy.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class Outcome(str, enum.Enum):
    TRANSFERRED = "transferred"  # the blocks landed (point-to-point) or wait in a store
    RECOMPUTED = "recomputed"  # they did not land; by its policy the decode computes the prompt
    FAILED = "failed"  # they did not land (and, decided, the request fails)
    ABORTED = "aborted"  # the request ended before the transfer did
    LOCAL = "local"  # no transfer was asked for: the decode prefilled the prompt itself


RECOMPUTE = "recompute"  # the pseudo-backend that ends a chain, and the failure policy's name
FAILURE_POLICIES = (RECOMPUTE, "fail")


@dataclass(frozen=True, slots=True)
class Fallback:
    """A backend that did not carry the transfer, and why."""

    backend: str
    reason: str
    duration_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TransferVerdict:
    """The outcome of one transfer.

    `fetch_keys` is set when a store carried the blocks: the receiver fetches
    `fetch_keys[i]` from store `backend` into its i-th destination block. A non-negative key
    is a block's content hash; a negative one is a short-lived key of a partial block
    (`codec.ephemeral_key`).
    """

    transfer_id: str  # hex
    outcome: Outcome
    backend: str  # the backend that carried the blocks, "recompute", or "" (failed/aborted)
    num_blocks: int = 0
    num_bytes: int = 0
    duration_s: float = 0.0
    fallbacks: tuple[Fallback, ...] = ()
    fetch_keys: tuple[int, ...] = ()
    # Sender side: from the end of the prompt's forward to this verdict in hand (for ucx/nccl
    # that is after the receiver verified every block). 0: no send ran.
    tail_s: float = 0.0
    # Sender side, a layer-wise stream: messages sent (one layer of one prefill step's blocks
    # each) and the mean time of one. 0: the prompt went as one message.
    num_messages: int = 0
    layer_send_s: float = 0.0
    # Receiver side, the request's verdict: why this outcome ("" for a transfer that landed;
    # "short_uncached_prompt", "prefill_unavailable: ...", "transfer_failed: ...", ...), the
    # peer that sent (a prefill worker id) and, when calling it failed, its status code
    reason: str = ""
    peer: str = ""
    peer_status: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == Outcome.TRANSFERRED

    @property
    def via_store(self) -> bool:
        return self.ok and bool(self.fetch_keys)

    def with_fallback(self, backend: str, reason: str, duration_s: float = 0.0) -> "TransferVerdict":
        """This verdict after the receiver could not use `backend` (e.g. a store miss): the
        KV did not land."""
        return replace(self, outcome=Outcome.FAILED, backend="",
                       fallbacks=self.fallbacks + (Fallback(backend, reason, duration_s),),
                       fetch_keys=())

    def describe(self) -> str:
        """One log line."""
        head = (f"transfer {self.transfer_id[:12]} {self.outcome.value}"
                + (f" via {self.backend}" if self.backend else "")
                + f": {self.num_blocks} blocks, {self.num_bytes} B in {self.duration_s * 1e3:.1f} ms"
                + (f" (tail {self.tail_s * 1e3:.1f} ms after the forward)" if self.tail_s else "")
                + (f", streamed in {self.num_messages} layer messages of {self.layer_send_s * 1e3:.2f} ms"
                   if self.num_messages else ""))
        if not self.fallbacks:
            return head
        tried = "; ".join(f"{f.backend}: {f.reason}" for f in self.fallbacks)
        return f"{head} (fell back past {tried})"


def decide(settled: TransferVerdict, failure_policy: str) -> TransferVerdict:
    """The request's outcome, decided here only: from what the receiver settled (TRANSFERRED,
    ABORTED or LOCAL stand; KV that did not land is RECOMPUTED under the "recompute" policy,
    else FAILED), with the reason a failure carries."""
    if failure_policy not in FAILURE_POLICIES:
        raise ValueError(f"unknown failure policy {failure_policy!r}")
    if settled.outcome in (Outcome.TRANSFERRED, Outcome.ABORTED, Outcome.LOCAL):
        return settled
    reason = settled.reason or failure_reason(settled)
    if failure_policy == RECOMPUTE:
        return replace(settled, outcome=Outcome.RECOMPUTED, backend=RECOMPUTE, reason=reason)
    return replace(settled, outcome=Outcome.FAILED, backend="", reason=reason)


def failure_reason(verdict: TransferVerdict) -> str:
    """Why KV did not land, from its last fallback: "transfer_failed: ..."."""
    last = verdict.fallbacks[-1].reason if verdict.fallbacks else verdict.outcome.value
    return f"transfer_failed: {last}"
