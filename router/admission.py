"""The queue bound and the table of requests in flight (id -> decode worker, for Abort)."""
from __future__ import annotations

import contextlib
from typing import Iterator

from pdserve.common.errors import AlreadyExistsError, OverloadedError
from pdserve.router.worker_registry import Worker


class InFlight:
    """At most `max_queue` requests at once; one more is RATE_LIMITED with Retry-After."""

    def __init__(self, max_queue: int, retry_after_s: int) -> None:
        self._max_queue = max_queue
        self._retry_after_s = retry_after_s
        self._requests: dict[str, Worker | None] = {}  # id -> decode worker once routed

    def __len__(self) -> int:
        return len(self._requests)

    @contextlib.contextmanager
    def admit(self, request_id: str) -> Iterator[None]:
        if request_id in self._requests:
            raise AlreadyExistsError(f"request {request_id!r} is already in flight",
                                     param="request_id")
        if len(self._requests) >= self._max_queue:
            raise OverloadedError(f"the router has {len(self._requests)} requests in flight (limit "
                                  f"{self._max_queue}); retry later", retry_after_s=self._retry_after_s)
        self._requests[request_id] = None
        try:
            yield
        finally:
            del self._requests[request_id]

    def assign(self, request_id: str, decode: Worker) -> None:
        if request_id in self._requests:
            self._requests[request_id] = decode

    def decode_of(self, request_id: str) -> Worker | None:
        return self._requests.get(request_id)
