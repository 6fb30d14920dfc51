"""The TTFT phases of one client stream, across the decodes that served it (`RequestTimings`).

A decode reports the phases of its own first token, on that delta and on its last. A stream
that migrated has more than one decode: the phases it reports stay those of the request's
first token (the migration's re-prefill is not a TTFT), and the router adds what the moves
cost: `num_migrations`; `migration_ms`, the time the client's stream stood still, from the last
token before each loss (the lost Decode call's start, when no token had been sent) until the
stream went on (the next decode's first new token; its Decode call's start, when no token had
been sent, whose phases are then the first token's); and `resume_prefill_ms`, the new decodes'
prefill of the prompt and the tokens already sent, a part of `migration_ms`.
"""
from __future__ import annotations

import time
from typing import Callable

from pdserve.proto.pdserve.v1 import common_pb2, decode_pb2


class StreamTimings:
    """Fed the stream's events in order: `opening` before each Decode call, `relayed` for each
    message it relays (it may rewrite the message's timings), `lost` when a decode is lost
    and the stream migrates."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._first: common_pb2.RequestTimings | None = None  # the request's first token's phases
        self._num_migrations = 0
        self._migration_ms = 0.0
        self._resume_prefill_ms = 0.0
        self._opened_at = 0.0  # the current Decode call's start
        self._stalled_since: float | None = None  # a migration under way: the stream stands still since
        self._resuming = False  # the current decode continues tokens already sent
        self._leg_timed = False  # the current decode's phases were taken
        self.last_token_at: float | None = None  # the last token relayed, by any decode

    def opening(self) -> None:
        """A Decode call starts (the first, or one after a loss)."""
        self._opened_at = self._clock()
        self._resuming, self._leg_timed = self.last_token_at is not None, False
        if self._stalled_since is not None and not self._resuming:  # the next call's phases cover the rest
            self._migration_ms += (self._opened_at - self._stalled_since) * 1000
            self._stalled_since = None

    def lost(self) -> None:
        """The current decode was lost mid-stream; another one continues the request."""
        self._num_migrations += 1
        self._stalled_since = self.last_token_at if self.last_token_at is not None else self._opened_at

    def relayed(self, message: decode_pb2.DecodeResponse) -> None:
        """A message of the current decode, before it is relayed: its last message leaves with
        the stream's timings."""
        if message.token_ids:
            now = self._clock()
            if self._stalled_since is not None:
                self._migration_ms += (now - self._stalled_since) * 1000
                self._stalled_since = None
            self.last_token_at = now
        if message.HasField("timings") and not self._leg_timed:
            self._leg_timed = True
            if self._resuming:
                self._resume_prefill_ms += message.timings.prefill_ms
            elif self._first is None:
                self._first = common_pb2.RequestTimings()
                self._first.CopyFrom(message.timings)
        if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._fill(message)
        elif self._resuming:  # a resumed decode's own phases are no TTFT: the client never sees them
            message.ClearField("timings")

    def _fill(self, last: decode_pb2.DecodeResponse) -> None:
        if not self._num_migrations:
            return  # one decode: its own phases stand
        timings = last.timings
        timings.Clear()
        if self._first is not None:
            timings.CopyFrom(self._first)
        timings.num_migrations = self._num_migrations
        timings.migration_ms = self._migration_ms
        timings.resume_prefill_ms = self._resume_prefill_ms
