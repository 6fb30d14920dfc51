"""The queue bound and the table of requests in flight (router id -> owner, label, decode
worker; for Abort)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from pdserve.common.errors import AlreadyExistsError, OverloadedError
from pdserve.router.worker_registry import Worker


@dataclass(slots=True)
class _Entry:
    owner: str  # who may abort it; empty: no one (by Abort)
    label: str  # the client's name for it; empty: none
    decode: Worker | None = None  # once routed


class InFlight:
    """At most `max_queue` requests at once; one more is RATE_LIMITED with Retry-After.
    Requests are keyed by the router's id. A label is unique among its owner's requests in
    flight, and only that owner finds a request (by label or id): an owner learns nothing of
    another's requests, a duplicate label included."""

    def __init__(self, max_queue: int, retry_after_s: int) -> None:
        self._max_queue = max_queue
        self._retry_after_s = retry_after_s
        self._requests: dict[str, _Entry] = {}
        self._labelled: dict[tuple[str, str], str] = {}  # (owner, label) -> router id

    def __len__(self) -> int:
        return len(self._requests)

    @contextlib.contextmanager
    def admit(self, request_id: str, owner: str = "", label: str = "") -> Iterator[None]:
        """Hold `request_id` (a router id, unique) in flight; `label` (when given) must be
        free among `owner`'s requests (ALREADY_EXISTS)."""
        key = (owner, label)
        if label and key in self._labelled:
            raise AlreadyExistsError(f"request_id {label!r} is already in flight on this connection",
                                     param="request_id")
        if len(self._requests) >= self._max_queue:
            raise OverloadedError(f"the router has {len(self._requests)} requests in flight (limit "
                                  f"{self._max_queue}); retry later", retry_after_s=self._retry_after_s)
        self._requests[request_id] = _Entry(owner, label)
        if label:
            self._labelled[key] = request_id
        try:
            yield
        finally:
            del self._requests[request_id]
            if label:
                del self._labelled[key]

    def assign(self, request_id: str, decode: Worker) -> None:
        if (entry := self._requests.get(request_id)) is not None:
            entry.decode = decode

    def decode_of(self, request_id: str) -> Worker | None:
        entry = self._requests.get(request_id)
        return None if entry is None else entry.decode

    def find(self, owner: str, key: str) -> str | None:
        """The router id of `owner`'s request in flight whose label or router id is `key`;
        None for anyone else's (and for an empty owner)."""
        if not owner or not key:
            return None
        if (request_id := self._labelled.get((owner, key))) is not None:
            return request_id
        entry = self._requests.get(key)
        return key if entry is not None and entry.owner == owner else None
