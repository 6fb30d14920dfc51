"""KV hand-offs: the decode's order to a prefill to write a prompt's KV into its blocks.

Threat: a prefill made to send KV where an attacker says (a forged or altered hand-off), to
write another prompt's KV into a decode's reserved blocks (a captured hand-off carried over
to another request), to act on a hand-off presented by someone other than the decode it
names, or to act on one hand-off twice (a replay).

Rule: a hand-off is signed by the decode under the `handoff` key over every field of the
hand-off but the signature and every field of the request it is for (`HandoffClaim`); a
prefill acts on it only when the signature holds, when the caller its credential names is
the decode the hand-off names (`check_presenter`), and only once: a `HandoffLedger` keeps
each accepted transfer id until its deadline, which may be at most MAX_HANDOFF_HORIZON_S
ahead. The proto side (which proto field fills which claim field) is an adapter in
`pdserve.worker.transfer`.
"""
from __future__ import annotations

import heapq
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from pdserve.common.block_hash import hashes_digest, prompt_digest
from pdserve.common.errors import AuthError, OverloadedError
from pdserve.common.util import encode_fields
from pdserve.security.secret import Mac

MAX_HANDOFF_HORIZON_S = 3600.0  # a hand-off's deadline may be at most this far ahead


class HandoffCallerError(AuthError):
    """A hand-off presented by a caller other than the decode it names."""


class ReplayedHandoffError(AuthError):
    """A hand-off this prefill has accepted before (each is used once)."""


@dataclass(frozen=True, slots=True)
class HandoffClaim:
    """What a decode's signature on a hand-off covers: the hand-off's fields and its
    request's (id, prompt, the decode's block hashes, sampling, cache salt), so a captured
    hand-off can neither carry another prompt's KV into the same blocks nor draw its first
    token otherwise. `sampling` is the request's sampling settings, serialized
    deterministically."""

    transfer_id: str
    backends: Sequence[str]
    endpoints: Sequence[tuple[str, str]]  # (backend, address)
    block_ids: Sequence[int]
    num_cached_tokens: int
    deadline_unix_ms: int
    compatibility_hash: int
    decode_worker_id: str
    request_id: str
    prompt_token_ids: Sequence[int]
    block_hashes: Sequence[int]
    sampling: bytes
    cache_salt: str
    lora: tuple[str, str] = ("", "")  # the adapter's (name, digest) the KV is computed under; empty: base

    def signed_fields(self) -> tuple:
        """The fields the MAC is computed over. Each list is length-prefixed item by item
        (`encode_fields`): no two different lists encode alike; the prompt and the block
        hashes enter as SHA-256 digests."""
        endpoints = [part for backend, address in self.endpoints for part in (backend, address)]
        return ("handoff-v3", self.transfer_id, _encoded_list(self.backends), _encoded_list(endpoints),
                struct.pack(f"<{len(self.block_ids)}I", *self.block_ids), self.num_cached_tokens,
                self.deadline_unix_ms, self.compatibility_hash, self.decode_worker_id, self.request_id,
                prompt_digest(self.prompt_token_ids), hashes_digest(self.block_hashes), self.sampling,
                self.cache_salt, *((_encoded_list(self.lora),) if any(self.lora) else ()))


def _encoded_list(items: Sequence[str]) -> bytes:
    return encode_fields(len(items), *items)


def sign(mac: Mac, claim: HandoffClaim) -> bytes:
    """The decode's signature on `claim` (a MAC under the `handoff` key)."""
    return mac.tag(*claim.signed_fields())


def check_signature(mac: Mac, claim: HandoffClaim, signature: bytes) -> None:
    """AuthError unless `signature` is a decode's signature on `claim`."""
    if not signature or not mac.check(signature, *claim.signed_fields()):
        raise AuthError("the hand-off is not signed by a decode of this deployment for this request")


def check_presenter(decode_worker_id: str, caller: str) -> None:
    """HandoffCallerError unless the verified `caller` is the decode the hand-off names."""
    if decode_worker_id != caller:
        raise HandoffCallerError(f"the hand-off names decode {decode_worker_id!r}; the caller is {caller!r}")


class HandoffLedger:
    """The hand-offs a prefill accepted, by transfer id, remembered until their deadline
    (after it a replay is refused as late anyway; a deadline is at most
    MAX_HANDOFF_HORIZON_S ahead): each is accepted once. Bounded: when
    `max_remembered` live ones are held, new ones are refused (OverloadedError) rather than
    an unexpired one forgotten."""

    def __init__(self, max_remembered: int = 100_000, clock: Callable[[], float] = time.time) -> None:
        self._max_remembered = max_remembered
        self._clock = clock
        self._live: set[str] = set()  # transfer ids accepted, deadline not passed
        self._by_deadline: list[tuple[float, str]] = []  # heap of (deadline unix s, transfer id), one per live id
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._live)

    def accept(self, transfer_id: str, deadline_unix_s: float) -> None:
        """Remember `transfer_id` until its deadline; ReplayedHandoffError if it is known."""
        now = self._clock()
        with self._lock:
            # expired ones go by deadline, whatever order they came in
            while self._by_deadline and self._by_deadline[0][0] < now:
                self._live.discard(heapq.heappop(self._by_deadline)[1])
            if transfer_id in self._live:
                raise ReplayedHandoffError(f"hand-off {transfer_id} was already used")
            if len(self._live) >= self._max_remembered:
                raise OverloadedError("too many live hand-offs remembered")
            self._live.add(transfer_id)
            heapq.heappush(self._by_deadline, (deadline_unix_s, transfer_id))
