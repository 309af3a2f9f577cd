"""429 ``queue_wait``: at the queue's drain rate the request could only wait out its bound
and get a 504 (Mooncake's early rejection, by queue drain rate)."""

from __future__ import annotations

from dataclasses import dataclass

from skymesh.routing.admission.base import Refusal, RegionView
from skymesh.routing.base import RoutingRequest


@dataclass(frozen=True, slots=True)
class QueueWaitRule:
    max_queue_wait_s: float
    retry_after_s: float

    def check(self, req: RoutingRequest, now: float, region: RegionView) -> Refusal | None:
        queued = region.queue_length
        if not queued:
            return None
        rate = region.service_rate_per_s(now)
        if rate is None:
            return None
        expected = (queued + 1) / rate
        bound = self.max_queue_wait_s
        if expected <= bound:
            return None
        # when to come back: once the queue has drained to within the bound, and never
        # later than one bound from now
        return Refusal(429, "queue_wait",
                       f"the balancer's queue would take ~{expected:.0f} s to reach this request "
                       f"(bound {bound:.0f} s)", min(expected - bound + self.retry_after_s, bound))
