"""The region's side of :class:`~skymesh.routing.admission.base.RegionView`: the read-only
window admission rules get, built from the region core's parts (the queue, its drain
rate, the local and peer first-token estimates, residency) rather than from the core, so a
rule can reach nothing it should not change."""

from __future__ import annotations

from skymesh.routing.base import RoutingRequest
from skymesh.routing.dispatcher import BalancerCore
from skymesh.routing.drain_rate import DrainRate
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.offload_selection import OffloadSelection
from skymesh.routing.residency import Residency


class RegionPartsView:
    """A :class:`~skymesh.routing.admission.base.RegionView` over one region's parts."""

    __slots__ = ("_queue", "_drain_rate", "_selection", "_offload", "_residency")

    def __init__(self, queue: BalancerCore, drain_rate: DrainRate, selection: OffloadSelection,
                 offload: OffloadRouter, residency: Residency) -> None:
        self._queue = queue
        self._drain_rate = drain_rate
        self._selection = selection
        self._offload = offload
        self._residency = residency

    @property
    def queue_length(self) -> int:
        return self._queue.queue_length

    def service_rate_per_s(self, now: float) -> float | None:
        return self._drain_rate.service_rate_per_s(now)

    def soonest_local_first_token_s(self, req: RoutingRequest, now: float) -> float | None:
        return self._selection.soonest_local_first_token_s(req, now)

    def soonest_peer_first_token_s(self, req: RoutingRequest, now: float) -> float:
        return self._offload.soonest_first_token_s(req, now)

    def nothing_can_serve(self, req: RoutingRequest, now: float) -> bool:
        return self._residency.nothing_can_serve(req, now)

    def why_nothing_can_serve(self, req: RoutingRequest, now: float) -> str:
        return self._residency.why_nothing_can_serve(req, now)
