"""503 ``no_capacity``: nothing here or at a peer may serve the request, so queueing it
could only end in a timeout."""

from __future__ import annotations

from dataclasses import dataclass

from skymesh.routing.admission.base import Refusal, RegionView
from skymesh.routing.base import RoutingRequest


@dataclass(frozen=True, slots=True)
class NoCapacityRule:
    retry_after_s: float

    def check(self, req: RoutingRequest, now: float, region: RegionView) -> Refusal | None:
        if not region.nothing_can_serve(req, now):
            return None
        return Refusal(503, "no_capacity", "no replica or region that may serve this request is available: "
                       + region.why_nothing_can_serve(req, now),
                       self.retry_after_s)
