"""429 ``slo_unreachable``: Mooncake's early rejection, for a request with a TTFT target of
its own (its SLO class's): neither here nor any peer is expected to meet it, even leaving
its own prefill out."""

from __future__ import annotations

from dataclasses import dataclass

from skymesh.routing.admission.base import Refusal, RegionView
from skymesh.routing.base import RoutingRequest


@dataclass(frozen=True, slots=True)
class SloUnreachableRule:
    retry_after_s: float

    def check(self, req: RoutingRequest, now: float, region: RegionView) -> Refusal | None:
        target = req.slo_ttft_s
        if target is None or req.forwarded:  # a peer's forward: the origin already judged
            return None
        here = region.soonest_local_first_token_s(req, now)
        if here is None or here <= target:
            return None
        soonest = min(here, region.soonest_peer_first_token_s(req, now))
        if soonest <= target:
            return None
        return Refusal(429, "slo_unreachable",
                       f"no replica can start this request within its SLO class's {target:g} s time to first "
                       f"token (at best {soonest:.1f} s): not queued", max(self.retry_after_s, soonest - target))
