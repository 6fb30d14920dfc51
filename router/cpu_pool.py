"""CPU work of the request path (chat templating, tokenizing) off the event loop, in a pool
of bounded size and queue: a burst of large prompts waits its turn or is refused (429); it
never blocks heartbeats or other requests on the loop."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from pdserve.common.errors import OverloadedError


class CpuPool:
    def __init__(self, max_workers: int = 2, max_pending: int = 64, retry_after_s: int = 1) -> None:
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pdserve-tokenize")
        self._max_pending = max_pending
        self._retry_after_s = retry_after_s
        self.num_pending = 0

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a pool thread; RATE_LIMITED when `max_pending` calls already wait or run."""
        if self.num_pending >= self._max_pending:
            raise OverloadedError("too many prompts are being prepared; retry shortly",
                                  retry_after_s=self._retry_after_s)
        self.num_pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self.num_pending -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
