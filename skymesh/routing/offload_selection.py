"""Which queued requests go to a peer region, and where: the two offload triggers.

:class:`OffloadSelection` reads the queue (the dispatcher's read side), the queue's
service rate (:class:`~skymesh.routing.drain_rate.DrainRate`) and the peers
(:class:`~skymesh.routing.offload.OffloadRouter`), and returns ``(request, region)``
pairs; the region coordinator takes them out of the queue and forwards them. Two
triggers: *predicted TTFT* (a peer is expected to answer sooner than the wait here) and
*saturated* (SkyWalker's rule: nothing here is available). The soonest first token here,
which admission weighs against the peers', is the same local-wait estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from skymesh.routing.base import ReplicaView, RoutingRequest
from skymesh.routing.drain_rate import DrainRate
from skymesh.routing.offload import OffloadRouter

Choice = tuple[RoutingRequest, str]


class QueueReadSide(Protocol):
    """What the selection reads of the queue and its replicas
    (:class:`~skymesh.routing.dispatcher.BalancerCore`); it never changes them."""

    lookahead: int
    replicas: dict[str, ReplicaView]

    @property
    def queue_length(self) -> int: ...

    def iter_queued(self) -> Iterator[RoutingRequest]: ...

    def free_dispatch_slots(self) -> int: ...

    def queued_ahead_of(self, priority: int) -> int: ...

    def any_available(self) -> bool: ...

    def has_allowed_available(self, req: RoutingRequest) -> bool: ...


class OffloadSelection:
    """Chooses the queued requests a peer region should serve. Each chosen request is
    booked with the offload router (``on_forwarded``) as it is chosen, so the next choice
    sees the peer's queue grown."""

    __slots__ = ("_queue", "_drain_rate", "_offload", "_forbidden_for")

    def __init__(self, queue: QueueReadSide, drain_rate: DrainRate, offload: OffloadRouter,
                 forbidden_for: Callable[[RoutingRequest], frozenset[str]]) -> None:
        self._queue = queue
        self._drain_rate = drain_rate
        self._offload = offload
        # replicas residency closes to a request (the coordinator's rules)
        self._forbidden_for = forbidden_for

    @property
    def predicted_ttft_on(self) -> bool:
        """Whether offload is on with the predicted-TTFT trigger."""
        return self._offload.enabled and self._offload.trigger == "predicted_ttft"

    def predicted_ttft(self, now: float) -> list[Choice]:
        """The predicted-TTFT trigger, before dispatch: :meth:`faster_elsewhere` when it is
        on, something is queued and a peer is known; else nothing."""
        if self.predicted_ttft_on and self._queue.queue_length and self._offload.peers:
            return self.faster_elsewhere(now)
        return []

    def saturated(self, now: float, restricted: bool) -> list[Choice]:
        """SkyWalker's rule, after dispatch: what is still queued while no local replica is
        available goes to a peer with a free replica (with the predicted trigger, only while
        the region has no offload rate to predict with). ``restricted``: residency may close
        local replicas to some queued requests (adopted replicas, requests from another
        region); those are offered to peers even while the replicas look free."""
        queue, offload = self._queue, self._offload
        if (
            offload.enabled and queue.queue_length
            and (restricted or not queue.any_available())
            and (not self.predicted_ttft_on or restricted or not self._drain_rate.has_offload_rate(now))
        ):
            return self.saturated_offload(now, restricted)
        return []

    def faster_elsewhere(self, now: float) -> list[Choice]:
        """Queued requests (head first) a peer is expected to answer sooner than this
        region. A request's wait here: nothing while it fits in the replicas' free
        dispatch slots, else its place beyond them (after those forwarded ahead of it)
        over the queue's offload rate (:meth:`DrainRate.offload_rate_per_s`: what the
        replicas have been taking, not admission's floor); plus the prefill already ahead of it on the least
        loaded replica it could go to (an available one within the free slots, else any
        healthy one). Only the first ``lookahead`` requests kept here are looked at:
        further back the wait here is long, and they are reached as the head moves."""
        queue, offload = self._queue, self._offload
        free = queue.free_dispatch_slots()
        s_per_token = offload.prefill_s_per_token
        views = queue.replicas.values()
        # what fits in the free slots goes to an available replica; the rest to whichever
        # healthy replica frees first. Each term is read once, when a request first needs
        # it (choosing forwards changes none of them: the queue, its replicas and its rate
        # stay as they are until the chosen leave it)
        on_available: float | None = None
        on_any: float | None = None
        rate: float | None = None
        rate_read = False
        chosen: list[Choice] = []
        kept = 0
        for req in queue.iter_queued():
            if kept >= queue.lookahead:
                break
            if kept < free:
                if on_available is None:
                    on_available = s_per_token * min((v.pending_prefill_tokens for v in views if v.available),
                                                     default=0)
                local_wait = on_available
            else:
                if not rate_read:
                    rate, rate_read = self._drain_rate.offload_rate_per_s(now), True
                if rate is None:
                    break  # no drain rate yet: the saturated rule after dispatch decides the rest
                if on_any is None:
                    on_any = s_per_token * min((v.pending_prefill_tokens for v in views if v.healthy), default=0)
                local_wait = (kept - free + 1) / rate + on_any
            region = offload.choose(req, now, local_wait)
            if region is None:
                kept += 1
                continue
            offload.on_forwarded(req, region, now)
            chosen.append((req, region))
        return chosen

    def saturated_offload(self, now: float, restricted: bool) -> list[Choice]:
        """Queued requests not forwarded here already, head first, each to the peer the
        router chooses; with ``restricted``, those a free local replica may serve stay."""
        queue, offload = self._queue, self._offload
        chosen: list[Choice] = []
        for req in queue.iter_queued():
            if req.forwarded:
                continue
            if restricted and queue.has_allowed_available(req):
                continue  # a local replica it may use is free: it is served here
            region = offload.choose(req, now)
            if region is None:
                if req.origin_region is None and not offload.candidates(now):
                    break  # no peer has room for this region's own clients: stop scanning
                continue
            offload.on_forwarded(req, region, now)
            chosen.append((req, region))
        return chosen

    def soonest_local_first_token_s(self, req: RoutingRequest, now: float) -> float | None:
        """When a replica here is expected to start ``req``'s first token at the soonest if
        it were queued now: nothing while the free dispatch slots cover every request of its
        priority or higher already queued, else the requests beyond them over the queue's
        service rate (the one predicted term); plus the prefill already on the least loaded
        healthy replica its rules allow. Its own prefill is left out (what it will find
        cached is the policy's call), so the estimate leans early. None while there is no
        drain rate to go by."""
        queue = self._queue
        ahead = queue.queued_ahead_of(req.priority)
        free = queue.free_dispatch_slots()
        if ahead < free:
            wait = 0.0
        else:
            rate = self._drain_rate.service_rate_per_s(now)
            if rate is None:
                return None
            wait = (ahead - free + 1) / rate
        forbidden = self._forbidden_for(req)
        pending = min((v.pending_prefill_tokens for rid, v in queue.replicas.items()
                       if v.healthy and rid not in forbidden), default=None)
        if pending is None:
            return None  # no replica here: the no-capacity rule decides
        return wait + self._offload.prefill_s_per_token * max(0, pending)

