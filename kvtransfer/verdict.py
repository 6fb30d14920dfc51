"""Two answers, two types: did one request's KV land (`TransferVerdict`, its `Landing`), and
what did the request do about it (`RequestVerdict`, its `Outcome`).

Every transfer ends in exactly one `TransferVerdict`, whichever way it ends. A fallback is
never silent: each backend that was tried (or skipped) before the one that answered is
listed with its reason. Senders and the receiver's settlement say only whether the KV landed
(LANDED, MISSING with a reason, or ABORTED); what the request does about KV that did not land
is decided once, by `decide` under the decode's failure policy, and only that decision has an
`Outcome`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class Landing(str, enum.Enum):
    """Whether a transfer's KV landed: what senders and the receiver's settlement say."""

    LANDED = "landed"  # the blocks landed (point-to-point) or wait in a store
    MISSING = "missing"  # they did not land; the verdict's reason or last fallback says why
    ABORTED = "aborted"  # the request ended before the transfer did


class Outcome(str, enum.Enum):
    """What the request did about its KV: decided once, by `decide` (or LOCAL, by placement)."""

    TRANSFERRED = "transferred"  # its KV landed: the decode decodes from it
    RECOMPUTED = "recomputed"  # it did not land; by its policy the decode computes the prompt
    FAILED = "failed"  # it did not land; by its policy the request fails
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
    """How one transfer ended: whether its KV landed, through which backend, at what cost.

    `fetch_keys` is set when a store carried the blocks: the receiver fetches
    `fetch_keys[i]` from store `backend` into its i-th destination block. A non-negative key
    is a block's content hash; a negative one is a short-lived key of a partial block
    (`codec.ephemeral_key`).
    """

    transfer_id: str  # hex
    landing: Landing
    backend: str  # the backend that carried the blocks, or "" (missing/aborted)
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
    # Why the KV is missing when a step other than a backend said so ("" otherwise: the
    # last fallback says why; "no_usable_kv_backend: ...", "prefill_unavailable: ...",
    # "aborted", ...), the peer that sent (a prefill worker id, receiver side) and, when
    # calling it failed, its status code
    reason: str = ""
    peer: str = ""
    peer_status: str = ""

    @property
    def ok(self) -> bool:
        return self.landing == Landing.LANDED

    @property
    def via_store(self) -> bool:
        return self.ok and bool(self.fetch_keys)

    def with_fallback(self, backend: str, reason: str, duration_s: float = 0.0) -> "TransferVerdict":
        """This verdict after the receiver could not use `backend` (e.g. a store miss): the
        KV did not land."""
        return replace(self, landing=Landing.MISSING, backend="",
                       fallbacks=self.fallbacks + (Fallback(backend, reason, duration_s),),
                       fetch_keys=())

    def describe(self) -> str:
        """One log line."""
        head = (f"transfer {self.transfer_id[:12]} {self.landing.value}"
                + (f" via {self.backend}" if self.backend else "")
                + f": {self.num_blocks} blocks, {self.num_bytes} B in {self.duration_s * 1e3:.1f} ms"
                + (f" (tail {self.tail_s * 1e3:.1f} ms after the forward)" if self.tail_s else "")
                + (f", streamed in {self.num_messages} layer messages of {self.layer_send_s * 1e3:.2f} ms"
                   if self.num_messages else ""))
        if not self.fallbacks:
            return head
        tried = "; ".join(f"{f.backend}: {f.reason}" for f in self.fallbacks)
        return f"{head} (fell back past {tried})"


NO_TRANSFER = TransferVerdict("", Landing.MISSING, "")  # the transfer of a request that asked for none


@dataclass(frozen=True, slots=True)
class RequestVerdict:
    """The request's outcome, from its transfer's verdict (`decide`), with the reason that
    goes to the response, the metrics and the log: "" for KV that landed, the placement's
    reason for LOCAL ("short_uncached_prompt", ...), else why the KV is missing."""

    outcome: Outcome
    transfer: TransferVerdict = NO_TRANSFER
    reason: str = ""

    @classmethod
    def local(cls, reason: str) -> "RequestVerdict":
        return cls(Outcome.LOCAL, NO_TRANSFER, reason)

    @property
    def backend(self) -> str:
        """The backend that carried the KV, "recompute" when the decode computes it, else ""."""
        if self.outcome == Outcome.RECOMPUTED:
            return RECOMPUTE
        return "" if self.outcome == Outcome.FAILED else self.transfer.backend


_STANDS = {Landing.LANDED: Outcome.TRANSFERRED, Landing.ABORTED: Outcome.ABORTED}


def decide(settled: TransferVerdict, failure_policy: str) -> RequestVerdict:
    """The request's outcome, decided here only: from what the receiver settled (KV that
    landed is TRANSFERRED, an aborted transfer ABORTED; KV that is missing is RECOMPUTED under
    the "recompute" policy, else FAILED), with the reason a missing one carries."""
    if failure_policy not in FAILURE_POLICIES:
        raise ValueError(f"unknown failure policy {failure_policy!r}")
    if settled.landing in _STANDS:
        return RequestVerdict(_STANDS[settled.landing], settled, settled.reason)
    reason = settled.reason or failure_reason(settled)
    return RequestVerdict(Outcome.RECOMPUTED if failure_policy == RECOMPUTE else Outcome.FAILED, settled, reason)


def failure_reason(verdict: TransferVerdict) -> str:
    """Why KV did not land, from its last fallback: "transfer_failed: ..."."""
    last = verdict.fallbacks[-1].reason if verdict.fallbacks else "failed"
    return f"transfer_failed: {last}"
