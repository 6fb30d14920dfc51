"""When the router sends a prompt over a link it stopped using (routing reason `link_probe`).

A decode's report of what it received from a prefill worker (`EngineCounters.received`) is
the only measure of that (prefill, decode) link, and only a transfer over it moves that
measure. Once a link measured slow, the planner prefills on the decode and the link would
stay priced slow for good, healed or not. So the measurement ages out: a link whose
reported transfer count has not moved for `interval_s` gets the next prompt that its cost
alone keeps local, and another only after `interval_s` more. At most one probe per link per
interval, the price of finding a healed link within an interval.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from pdserve.router.worker_registry import WorkerRecord

MAX_LINKS = 4096  # pairs remembered; the least recently measured go first


@dataclass(slots=True)
class _Link:
    num_transfers: int  # the decode's last reported count of transfers from the prefill worker
    measured_at: float  # when this router first saw that count: the measurement's age runs from here
    probed_at: float = float("-inf")  # this router's last probe over the link


class LinkProbes:
    """Per (decode, prefill) pair: the age of its measurement and when it was last probed.
    `interval_s` 0: never probe."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._links: dict[tuple[str, str], _Link] = {}

    def try_probe(self, decode: WorkerRecord, prefill_id: str) -> float | None:
        """Seconds since the link from `prefill_id` to `decode` was last measured, when a probe
        is due now (it is then counted as sent); else None. A link never measured is never
        probed: it costs nothing in the prediction, so prompts use it anyway."""
        num_transfers = reported_transfers(decode, prefill_id)
        if not self._interval_s or num_transfers == 0:
            return None
        now = self._clock()
        link = self._seen(decode.worker_id, prefill_id, num_transfers, now)
        age_s = now - link.measured_at
        if age_s < self._interval_s or now - link.probed_at < self._interval_s:
            return None
        link.probed_at = now
        return age_s

    def _seen(self, decode_id: str, prefill_id: str, num_transfers: int, now: float) -> _Link:
        key = (decode_id, prefill_id)
        link = self._links.get(key)
        if link is None:
            if len(self._links) >= MAX_LINKS:
                del self._links[min(self._links, key=lambda k: self._links[k].measured_at)]
            link = self._links[key] = _Link(num_transfers, now)
        elif link.num_transfers != num_transfers:
            link.num_transfers, link.measured_at = num_transfers, now
        return link


def reported_transfers(decode: WorkerRecord, prefill_id: str) -> int:
    """Transfers from `prefill_id` that `decode` reported receiving (0: none, or no report)."""
    counters = decode.load.counters
    if counters is None:
        return 0
    return next((int(link.transfers) for link in counters.received if link.peer == prefill_id), 0)
