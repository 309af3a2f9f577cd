"""One region's read side, pure: what its core knows, and no way to change it.

:class:`RegionReadView` is the region core's read side: everything a daemon, the simulator,
``/admin/status``, the heartbeat and the metrics read of one region (the queue and its
replicas, the request table, the replicas' health, the queue's drain rate, the soonest
first token here, the state published to peers) and no method that changes state. The
core (:class:`~skymesh.routing.region.RegionCore`, which keeps the events and the request
lifecycle) builds one over its parts and hands it out as ``RegionCore.view``; every read
goes to the part that owns the answer at the moment it is asked, so the view is never
stale (siblings attached after it was built included).

Not to be confused with :class:`skymesh.routing.admission.base.RegionView`, the narrower
window the admission rules read (built by
:class:`~skymesh.routing.admission.region_view.RegionPartsView`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from skymesh.routing.base import Policy, ReplicaView, RoutingRequest
from skymesh.routing.dispatcher import BalancerCore, DispatchCounters
from skymesh.routing.drain_rate import DrainRate
from skymesh.routing.health import ReplicaHealth
from skymesh.routing.heartbeat import HeartbeatSnapshot
from skymesh.routing.offload_selection import OffloadSelection
from skymesh.routing.request_state import RequestState
from skymesh.routing.siblings import RegionSiblings


class TrackedRequest(Protocol):
    """What the view reads of one accepted request the core tracks."""

    @property
    def req(self) -> RoutingRequest: ...

    @property
    def state(self) -> RequestState: ...


class RegionReadView:
    """The region core's read side (see the module's docstring): reads only, over the
    core's own parts, never a copy of them."""

    __slots__ = ("_local", "_health", "_drain_rate", "_offload_selection", "_requests", "_transitions",
                 "_siblings")

    def __init__(
        self,
        local: BalancerCore,
        health: ReplicaHealth,
        drain_rate: DrainRate,
        offload_selection: OffloadSelection,
        requests: Mapping[str, TrackedRequest],
        transitions: Mapping[tuple[str, str], int],
        siblings: Callable[[], RegionSiblings | None],
    ) -> None:
        """``requests``: the core's request table (request id -> its tracked state), read
        live; ``transitions``: its counted state moves; ``siblings``: the region's other
        balancers as attached now (None: this balancer is the region's only one)."""
        self._local = local
        self._health = health
        self._drain_rate = drain_rate
        self._offload_selection = offload_selection
        self._requests = requests
        self._transitions = transitions
        self._siblings = siblings

    @property
    def policy(self) -> Policy:
        return self._local.policy

    @property
    def replicas(self) -> dict[str, ReplicaView]:
        return self._local.replicas

    @property
    def counters(self) -> DispatchCounters:
        return self._local.counters

    @property
    def queue_length(self) -> int:
        return self._local.queue_length

    @property
    def in_flight_count(self) -> int:
        return self._local.in_flight_count

    @property
    def active_requests(self) -> int:
        """Requests accepted and not yet in a terminal state (queued, placed, streaming)."""
        return len(self._requests)

    def available_count(self) -> int:
        return self._local.available_count()

    def available_for_new_requests(self) -> int:
        """Available replicas a new request may start on (:meth:`Dispatcher.available_for_new_requests`)."""
        return self._local.available_for_new_requests()

    def own_pending_prefill(self, replica_id: str) -> int:
        """Prefill tokens this balancer's requests on ``replica_id`` still have to go."""
        return self._local.own_pending_prefill(replica_id)

    def ejected_count(self) -> int:
        return self._health.ejected_count()

    def any_available(self) -> bool:
        return self._local.any_available()

    def pending_prefill_tokens(self) -> int:
        return self._local.pending_prefill_tokens()

    def region_pending_prefill_tokens(self) -> int:
        """Prefill work queued or dispatched without a first token in the whole region:
        this balancer's and, in a region of several, its siblings' as they last said."""
        own = max(0, self._local.pending_prefill_tokens())
        siblings = self._siblings()
        return own if siblings is None else own + siblings.pending_prefill_tokens_as_of_step()

    def request_of(self, request_id: str) -> RoutingRequest:
        return self._requests[request_id].req

    def transfer_estimate_s(self, request_id: str) -> float:
        """A split request's KV move to its decode replica, estimated (0: none)."""
        return self._local.transfer_estimate_s(request_id)

    def state_of(self, request_id: str) -> RequestState | None:
        t = self._requests.get(request_id)
        return t.state if t is not None else None

    def ages(self, now: float) -> dict[str, tuple[str, float]]:
        """Every live request's state and age (for failure reports and /admin/status)."""
        return {rid: (t.state.value, now - t.req.arrival) for rid, t in self._requests.items()}

    def heartbeat(self, now: float) -> HeartbeatSnapshot:
        """The region's state for its peers: with siblings, their queues, prefill and
        placement rates count too (one region, however many balancers)."""
        local = self._local
        queue, prefill, rate = local.queue_length, max(0, local.pending_prefill_tokens()), \
            self.offload_rate_per_s(now) or 0.0
        siblings = self._siblings()
        if siblings is not None:
            queue += siblings.queue_length(now)
            prefill += siblings.pending_prefill_tokens(now)
            rate += siblings.placements_per_s(now)
        return HeartbeatSnapshot(
            # the replicas a request forwarded here may start on (a decode-only one may not)
            replicas_total=local.replicas_for_new_requests(),
            replicas_available=local.available_for_new_requests(),
            queue_length=queue,
            pending_prefill_tokens=prefill,
            placements_per_s=rate,
        )

    def first_token_s(self) -> float:
        """A replica's predicted time to give back a unit of its dispatch budget
        (:meth:`DrainRate.first_token_s`)."""
        return self._drain_rate.first_token_s()

    def service_rate_per_s(self, now: float) -> float | None:
        """How fast the queue drains, requests per second (:meth:`DrainRate.service_rate_per_s`)."""
        return self._drain_rate.service_rate_per_s(now)

    def offload_rate_per_s(self, now: float) -> float | None:
        """How fast offload (and the peers, by the heartbeat) take the queue to drain,
        requests per second (:meth:`DrainRate.offload_rate_per_s`)."""
        return self._drain_rate.offload_rate_per_s(now)

    def expected_queue_wait_s(self, now: float) -> float | None:
        """How long a request queued now would wait for its placement (:meth:`DrainRate.expected_queue_wait_s`)."""
        return self._drain_rate.expected_queue_wait_s(now)

    def soonest_local_first_token_s(self, req: RoutingRequest, now: float) -> float | None:
        """When a replica here would start ``req``'s first token at the soonest if it were
        queued now (:meth:`OffloadSelection.soonest_local_first_token_s`)."""
        return self._offload_selection.soonest_local_first_token_s(req, now)

    def health_of(self, replica_id: str) -> dict[str, Any]:
        return self._health.report(replica_id)

    def snapshot(self) -> dict[str, Any]:
        """The region for /admin/status: the queue's and replicas' snapshot, each
        replica's health, the live requests and the counted transitions."""
        snap = self._local.snapshot()
        for rid, view in snap["replicas"].items():
            view["health"] = self.health_of(rid)
        snap["active_requests"] = len(self._requests)
        snap["transitions"] = {f"{a}>{b}": n for (a, b), n in sorted(self._transitions.items())}
        return snap
