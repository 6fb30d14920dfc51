"""Each tenant's limits (`security.tenants.TenantLimits`): requests and tokens per minute,
and requests in flight. A request over any of them is RATE_LIMITED (HTTP 429) with a
Retry-After saying when it would fit, before any worker is asked. Per-minute limits are
token buckets that hold one minute's allowance and refill continuously; a tenant's state
outlives a reload of the keys file (it is kept by tenant name)."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from pdserve.common.errors import OverloadedError
from pdserve.security.tenants import Tenant


@dataclass(slots=True)
class _Bucket:
    level: float
    at: float

    def refill(self, per_minute: int, now: float) -> None:
        self.level = min(float(per_minute), self.level + (now - self.at) * per_minute / 60.0)
        self.at = now

    def wait_s(self, amount: float, per_minute: int) -> int:
        """Whole seconds until `amount` fits (at least 1)."""
        return max(1, math.ceil((amount - self.level) * 60.0 / per_minute))


@dataclass(slots=True)
class _State:
    requests: _Bucket
    tokens: _Bucket
    in_flight: int = 0


class TenantLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._states: dict[str, _State] = {}

    def _state(self, tenant: Tenant, now: float) -> _State:
        state = self._states.get(tenant.name)
        if state is None:
            limits = tenant.limits
            state = self._states[tenant.name] = _State(_Bucket(limits.requests_per_minute, now),
                                                        _Bucket(limits.tokens_per_minute, now))
        return state

    @contextlib.contextmanager
    def hold(self, tenant: Tenant | None) -> Iterator[None]:
        """Count one request of `tenant` (None: no limits) while it runs: RATE_LIMITED when
        it has `in_flight` requests running, or no request left this minute."""
        if tenant is None:
            yield
            return
        limits, now = tenant.limits, self._clock()
        state = self._state(tenant, now)
        if limits.in_flight and state.in_flight >= limits.in_flight:
            raise OverloadedError(f"this key has {state.in_flight} requests in flight (its limit)", retry_after_s=1)
        if limits.requests_per_minute:
            state.requests.refill(limits.requests_per_minute, now)
            if state.requests.level < 1:
                raise OverloadedError("this key's requests per minute are spent",
                                      retry_after_s=state.requests.wait_s(1, limits.requests_per_minute))
            state.requests.level -= 1
        state.in_flight += 1
        try:
            yield
        finally:
            state.in_flight -= 1

    def charge_tokens(self, tenant: Tenant | None, tokens: int) -> None:
        """Take `tokens` (a request's prompt plus its max_tokens) from `tenant`'s minute:
        RATE_LIMITED when they do not fit (a request larger than a whole minute never does)."""
        if tenant is None or not tenant.limits.tokens_per_minute:
            return
        per_minute, now = tenant.limits.tokens_per_minute, self._clock()
        bucket = self._state(tenant, now).tokens
        bucket.refill(per_minute, now)
        if tokens > per_minute:
            raise OverloadedError(f"this request's {tokens} tokens are over this key's {per_minute} per minute",
                                  retry_after_s=60)
        if bucket.level < tokens:
            raise OverloadedError("this key's tokens per minute are spent",
                                  retry_after_s=bucket.wait_s(tokens, per_minute))
        bucket.level -= tokens
