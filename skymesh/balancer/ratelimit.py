"""Token buckets for per-client limits; pure (the caller passes ``now``), no clock inside.

A bucket holds up to ``capacity`` tokens and refills at ``rate`` tokens per second; a
request costing ``cost`` passes when that many are there and takes them. When it does not,
:meth:`TokenBucket.wait_s` says how long until it would, which is the 429's Retry-After.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenBucket:
    rate: float  # tokens added per second
    capacity: float  # the most tokens it holds (the burst)
    tokens: float = field(default=-1.0)  # starts full
    updated: float | None = None  # the `now` of the last refill

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.capacity <= 0:
            raise ValueError("a token bucket needs a positive rate and capacity")
        if self.tokens < 0:
            self.tokens = self.capacity

    def _refill(self, now: float) -> None:
        if self.updated is not None and now > self.updated:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        if self.updated is None or now > self.updated:
            self.updated = now

    def try_take(self, now: float, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens if they are there (then True); otherwise take nothing."""
        self._refill(now)
        if cost <= self.tokens:
            self.tokens -= cost
            return True
        return False

    def charge(self, now: float, cost: float) -> None:
        """Take ``cost`` tokens spent elsewhere (a sibling balancer of the region admitted
        that work, docs/routing.md "A region is a fleet"): taken whether or not they are
        there, the bucket going down to ``-capacity`` at most, and refilling from there."""
        self._refill(now)
        self.tokens = max(-self.capacity, self.tokens - cost)

    def wait_s(self, now: float, cost: float = 1.0) -> float:
        """Seconds until ``cost`` tokens are there; inf when more than the bucket holds."""
        if cost > self.capacity:
            return math.inf
        self._refill(now)
        return max(0.0, (cost - self.tokens) / self.rate)


def retry_after_header(wait_s: float) -> str:
    """Retry-After is whole seconds; rounding up so a retry at that time passes."""
    return str(max(1, math.ceil(wait_s)))
