"""Per-tenant request rate limits (token buckets), answered 429 with Retry-After.

Each process keeps its own buckets: with N API processes a tenant gets up to N times
the rate, which docs/security.md states; a shared limiter belongs in front (the proxy).
"""

from __future__ import annotations

import math
import threading
import time

from fastapi import HTTPException


class TenantRateLimiter:
    """`rate_per_s` units per second per tenant, bursts up to `burst` units."""

    def __init__(self, rate_per_s: float, burst: float):
        self.rate = rate_per_s
        self.burst = burst
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, tenant: str, cost: float = 1.0) -> float:
        """Take `cost` tokens; returns 0 when allowed, else the seconds to wait. A cost
        above the burst passes on a full bucket and leaves it in debt, so a big batch is
        slowed, never refused for ever."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        needed = min(cost, self.burst)
        with self._lock:
            tokens, at = self._buckets.get(tenant, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            if tokens >= needed:
                self._buckets[tenant] = (tokens - cost, now)
                return 0.0
            self._buckets[tenant] = (tokens, now)
            return (needed - tokens) / self.rate

    def check(self, tenant: str, cost: float = 1.0) -> None:
        """Raise 429 with Retry-After (whole seconds, at least 1) when over the limit."""
        if wait := self.take(tenant, cost):
            raise HTTPException(429, f"tenant {tenant!r} is over its rate limit; retry later",
                                headers={"Retry-After": str(max(1, math.ceil(wait)))})
