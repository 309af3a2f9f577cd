"""The balancer's queue and dispatch core (SkyWalker's selective pushing), pure.

Requests wait here, at the balancer, not at a busy replica: a replica is *available* only
while its last probe reported no waiting request (``vllm:num_requests_waiting == 0``),
it is not draining, and its push budget has room (skymesh/routing/push_budget.py: how
many requests may be pushed to it between probes, which pushes a page shows, and how a
region of several balancers shares each budget). A pick of a replica where this balancer
holds no free unit of a shared budget is counted as a *want*, which the unit's home
answers with a lease in its next message; the request keeps its pick and waits for it
(no per-use answer: one message of the home's, which a want sends at once).
A replica's ``pending_prefill_tokens`` in the views the policy sees is the region's: this
balancer's own plus what its siblings last said they have there without a first token
(the load a policy weighs; a sibling's share is as old as its last message).

The daemon (real sockets, real clock), the discrete-event simulator and the benchmarks all
drive this class; it never reads a clock or touches I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from skymesh.routing.base import Decision, Migration, Policy, ReplicaView, RoutingRequest
from skymesh.routing.disciplines.base import QueueDiscipline
from skymesh.routing.pairing.base import PairChoice, PairRule, Role, does_prefill
from skymesh.routing.push_budget import PushBudget
from skymesh.routing.queueing import PriorityQueue
from skymesh.routing.siblings import SiblingLoad

# in a region of several balancers: the most queued requests per dispatch round that a
# pick of a replica without a free unit here holds back (each one a want; the rest wait)
WANT_LOOKAHEAD = 8


@dataclass(slots=True)
class _Queued:
    req: RoutingRequest
    excluded: set[str] = field(default_factory=set)  # replicas that already failed it


# the legs of an in-flight request: whole on one replica, or a split one's prefill leg
# (on its prefill replica) and then its decode leg (on its decode replica)
WHOLE, PREFILL_LEG, DECODE_LEG = 0, 1, 2


@dataclass(slots=True)
class _InFlight:
    req: RoutingRequest
    replica_id: str  # the replica of its current leg
    dispatched_at: float
    prefill_tokens: int  # counted in the replica's pending_prefill_tokens until first token
    excluded: set[str]
    first_token_at: float | None = None
    leg: int = WHOLE
    decode_replica_id: str | None = None  # a split request's decode replica
    prefill_replica_id: str | None = None  # where its prefill leg ran, once it answered
    decode_tokens: int = 0  # the KV tokens booked there (prompt + output) until its first token
    transfer_s: float = 0.0  # the KV's move to the decode replica, as the pair rule estimated it


@dataclass(slots=True)
class DispatchCounters:
    submitted: int = 0
    rejected_queue_full: int = 0
    dispatched: int = 0
    retried: int = 0
    failed: int = 0
    completed: int = 0
    migrated: int = 0
    spilled: int = 0
    offloaded: int = 0
    refused_by_pair_rule: int = 0  # no placement met the request's TTFT and TBT targets


class QueueFull(Exception):
    """The bounded queue is full: the caller answers 429 with Retry-After."""


class BalancerCore:
    def __init__(
        self,
        policy: Policy,
        *,
        queue_bound: int = 1024,
        dispatch_budget: int = 2,
        lookahead: int = 64,
        rebalance_interval_s: float = 0.05,
    ) -> None:
        self.policy = policy
        self.queue_bound = queue_bound
        # each replica's push budget: what this balancer may still push there before its
        # next probe (alone, or sharing it with the region's other balancers)
        self.budget = PushBudget(dispatch_budget)
        self.lookahead = lookahead
        self.rebalance_interval_s = rebalance_interval_s
        self.replicas: dict[str, ReplicaView] = {}
        # kept with every change to a view's ``available`` or a budget's charge (the only
        # writers are this class's methods): the available replicas, and per available one
        # with free slots its count (what :meth:`_free_slots` gives for an unshared budget)
        # and their sum, so a tick's reads cost no scan of every replica
        self._available_ids: set[str] = set()
        self._free_slots_of: dict[str, int] = {}
        self._free_slots_total = 0
        # highest priority first (SLO classes), FCFS within a priority
        self._queue: PriorityQueue[_Queued] = PriorityQueue()
        self._queued_prompt_tokens = 0  # the prompt tokens of every queued request
        self._in_flight: dict[str, _InFlight] = {}
        self._last_rebalance = float("-inf")
        self.counters = DispatchCounters()
        self.dispatches_per_replica: dict[str, int] = {}
        self.migrations: list[Migration] = []  # the last rebalance's moves (for metrics)
        # residency: request -> replicas it may never run on (set by the region core only
        # while it holds replicas of another home region, e.g. adopted on failover)
        self.forbidden_for: Callable[[RoutingRequest], frozenset[str]] | None = None
        # queue discipline within a priority: None is FCFS; else the order it gives
        # (skymesh/routing/queue_registry.py names them); set before the first request
        self.discipline: QueueDiscipline | None = None
        # records a dispatch in the region's routing history once the discipline and the
        # policy were told of it (both read that history; set by the region core)
        self.record_dispatch: Callable[[RoutingRequest, str, float], None] | None = None
        # replica -> queued requests the last dispatch round's policy picked it for while
        # this balancer had no free unit there (siblings lend to them)
        self.wants: dict[str, int] = {}
        # replicas leaving membership: no new dispatch, requests in flight on them finish
        self.draining: frozenset[str] = frozenset()
        # prefill/decode pairs (skymesh/routing/pairing): each replica's role (missing:
        # ``both``) and the rule that splits requests; None: every request runs whole
        self.roles: dict[str, Role] = {}
        self._configured_roles: dict[str, Role] = {}  # set_roles's; the pair rule may plan others
        self._decode_only: frozenset[str] = frozenset()
        self.pair_rule: PairRule | None = None
        # requests the pair rule refused since the region core last took them (no
        # placement meets their targets): they left the queue, the core answers them 429
        self.refused: list[tuple[RoutingRequest, PairChoice]] = []

    @property
    def dispatch_budget(self) -> int:
        """Requests each replica may be pushed between probes (region-wide)."""
        return self.budget.dispatch_budget

    @dispatch_budget.setter
    def dispatch_budget(self, dispatch_budget: int) -> None:
        """A new budget (a config reload): each replica's free slots follow at once; its
        availability with its next event, as it always has."""
        self.budget.dispatch_budget = dispatch_budget
        for view in self.replicas.values():
            self._track(view)

    def loads(self) -> dict[str, SiblingLoad]:
        """Per replica, what this balancer has on it (what its siblings are told)."""
        return {rid: SiblingLoad(v.in_flight, self.budget.charged(rid), self.own_pending_prefill(rid))
                for rid, v in self.replicas.items()}

    def own_pending_prefill(self, replica_id: str) -> int:
        """Prefill tokens this balancer's requests on ``replica_id`` still have to go (the
        view's figure less the siblings' share in it)."""
        view = self.replicas.get(replica_id)
        return 0 if view is None else view.pending_prefill_tokens - self.budget.sibling_prefill_on(replica_id)

    def refresh_budgets(self) -> None:
        """A sibling step: the units held changed (availability follows) and the siblings'
        prefill on each replica is their latest word."""
        prefill_changes = self.budget.renew_sibling_prefill()
        for rid, view in self.replicas.items():
            change = prefill_changes.get(rid)
            if change is not None:
                view.pending_prefill_tokens += change
            self._refresh_available(view)

    # ------------------------------------------------------------------ membership/probes

    def set_replicas(self, replica_ids: Sequence[str]) -> None:
        """Replace membership. New replicas start unavailable until their first probe."""
        wanted = list(dict.fromkeys(replica_ids))
        for rid in list(self.replicas):
            if rid not in wanted:
                del self.replicas[rid]
                self.budget.remove_replica(rid)
                self._untrack(rid)
        for rid in wanted:
            if rid not in self.replicas:
                self.replicas[rid] = ReplicaView(replica_id=rid, healthy=False, available=False)
                self.budget.add_replica(rid)
                self.dispatches_per_replica.setdefault(rid, 0)
        self.policy.set_replicas([rid for rid in wanted if rid not in self._decode_only])
        if self.discipline is not None:
            self.discipline.set_replicas(wanted)

    def set_roles(self, roles: Mapping[str, Role]) -> None:
        """Each replica's role (missing: ``both``). Decode-only replicas are not offered to
        the policy: they take decode legs, or whole requests a pair rule sends them."""
        self._configured_roles = dict(roles)
        self._apply_roles(roles)

    def _apply_roles(self, roles: Mapping[str, Role]) -> None:
        self.roles = {rid: role for rid, role in roles.items() if role != "both"}
        decode_only = frozenset(rid for rid, role in self.roles.items() if not does_prefill(role))
        if decode_only != self._decode_only:  # the policy's replicas change only with it
            self._decode_only = decode_only
            self.policy.set_replicas([rid for rid in self.replicas if rid not in decode_only])

    def update_replica(
        self,
        replica_id: str,
        *,
        healthy: bool,
        num_running: int = 0,
        num_waiting: int = 0,
        kv_usage: float = 0.0,
        sent_at: float | None = None,
    ) -> None:
        """A probe result (a scrape of the replica's /metrics, or its failure); ``sent_at``:
        when the scrape was sent (None: not known)."""
        view = self.replicas.get(replica_id)
        if view is None:
            return
        view.healthy = healthy
        view.num_running = num_running
        view.num_waiting = num_waiting
        view.kv_usage = kv_usage
        # the page credits the pushes it shows; the rest stay charged to the budget
        self.budget.on_page(replica_id, healthy=healthy, in_flight=view.in_flight, num_running=num_running,
                            num_waiting=num_waiting, sent_at=sent_at)
        self._refresh_available(view)

    def _refresh_available(self, view: ReplicaView) -> None:
        rid = view.replica_id
        budget_left = self.budget.refresh(rid)
        view.available = view.healthy and view.num_waiting == 0 and budget_left and rid not in self.draining
        self._track(view)

    def _set_unavailable(self, view: ReplicaView) -> None:
        view.available = False
        self._track(view)

    def _track(self, view: ReplicaView) -> None:
        """After a change to ``view.available`` or its replica's budget: the available set
        and the free slots follow."""
        rid = view.replica_id
        slots = 0
        if view.available:
            self._available_ids.add(rid)
            slots = self.budget.free_slots(rid)
        else:
            self._available_ids.discard(rid)
        old = self._free_slots_of.pop(rid, 0)
        if slots > 0:
            self._free_slots_of[rid] = slots
            self._free_slots_total += slots - old
        else:
            self._free_slots_total -= old

    def _untrack(self, replica_id: str) -> None:
        self._available_ids.discard(replica_id)
        self._free_slots_total -= self._free_slots_of.pop(replica_id, 0)

    def set_draining(self, replica_ids: Iterable[str]) -> None:
        """The members that are leaving (the controller marks them draining): none of them
        gets a new dispatch; what is in flight on them finishes. A replica no longer named
        becomes available again with its next probe."""
        self.draining = frozenset(rid for rid in replica_ids if rid in self.replicas)
        for rid in self.draining:
            self._set_unavailable(self.replicas[rid])

    def eject(self, replica_id: str) -> None:
        """No dispatch to ``replica_id`` at all until a probe says it is healthy again."""
        view = self.replicas[replica_id]
        view.healthy = False
        self._set_unavailable(view)

    def hold(self, replica_id: str) -> None:
        """No new dispatch to ``replica_id`` until its next successful probe."""
        view = self.replicas.get(replica_id)
        if view is not None:
            self.budget.hold(replica_id)
            self._set_unavailable(view)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._in_flight

    def unstarted_on(self, replica_id: str) -> list[str]:
        """Requests dispatched to ``replica_id`` that have not produced a first token."""
        return [
            rid for rid, f in self._in_flight.items()
            if f.replica_id == replica_id and f.first_token_at is None
        ]

    def any_available(self) -> bool:
        return bool(self._available_ids)

    def free_dispatch_slots(self) -> int:
        """Requests the available replicas can still be sent before their next probe."""
        if self.budget.shared:
            # the units held here move with the siblings' messages and leases, outside
            # this class's events: counted afresh
            return sum(self._free_slots().values())
        return self._free_slots_total

    def available_count(self) -> int:
        return len(self._available_ids)

    def role_of(self, replica_id: str) -> Role:
        """``replica_id``'s prefill/decode role (``both`` unless :meth:`set_roles` said otherwise)."""
        return self.roles.get(replica_id, "both")

    def replicas_for_new_requests(self) -> int:
        """Replicas a new request may start on: those that prefill (roles ``both`` and
        ``prefill``); a decode-only replica takes decode legs. Every replica while all are ``both``."""
        return len(self.replicas) - sum(1 for rid in self._decode_only if rid in self.replicas)

    def available_for_new_requests(self) -> int:
        """Of :meth:`replicas_for_new_requests`, those available now (selective pushing)."""
        # the kept available set, not a scan: every dispatch round asks (the heartbeat)
        if not self._decode_only:
            return len(self._available_ids)
        return sum(1 for rid in self._available_ids if rid not in self._decode_only)

    def sustainable_dispatch_rate(self, now: float, first_token_s: float) -> float:
        """Requests per second the replicas can at least be sent from the queue, from
        what they can serve rather than from what they were recently sent: every healthy
        replica whose last probe showed no waiting request takes its dispatch budget per
        ``first_token_s`` (the predicted time a dispatched request takes to give its unit
        of budget back with its first token), or per the time its budget has now been
        spent with none back, when that is longer. A replica with requests waiting in its
        own queue (saturated), an unhealthy one and one held without a fresh probe add
        nothing: what they drain is the measured placement rate's to tell."""
        rate = 0.0
        for rid, view in self.replicas.items():
            if not view.healthy or view.num_waiting > 0 or rid in self.draining:
                continue
            rate += self.budget.push_rate(rid, now, first_token_s)
        return rate

    # ------------------------------------------------------------------ admission

    def submit(self, req: RoutingRequest, front: bool = False) -> None:
        """Queue a request (behind every request of its priority or a higher one; ``front``
        for one that already waited, e.g. a request a peer region bounced back: ahead of
        its own priority). Raises QueueFull when the bound is reached."""
        if len(self._queue) >= self.queue_bound:
            self.counters.rejected_queue_full += 1
            raise QueueFull(f"balancer queue is full ({self.queue_bound} requests waiting)")
        if req.request_id in self._queue or req.request_id in self._in_flight:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self._queue.push(req.request_id, _Queued(req), req.priority, front=front)
        self._queued_prompt_tokens += req.prompt_tokens
        if self.discipline is not None:
            self.discipline.on_queued(req)
        self.counters.submitted += 1

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def in_flight_count(self) -> int:
        return len(self._in_flight)

    def queued_ahead_of(self, priority: int) -> int:
        """Queued requests a new request of ``priority`` would wait behind."""
        return self._queue.at_or_above(priority)

    def queued_requests(self) -> list[RoutingRequest]:
        return [q.req for q in self._queue.values()]

    def iter_queued(self) -> Iterator[RoutingRequest]:
        """Queued requests in order, lazily: a scan that stops early (the offload scans, on
        every tick) does not copy the whole queue. The queue must not change meanwhile."""
        return (q.req for q in self._queue.values())

    def queued_prefill_tokens(self) -> int:
        return self._queued_prompt_tokens

    def pending_prefill_tokens(self) -> int:
        """This balancer's own: its requests' prefill still to go on every replica, and its
        queue's (the siblings' share in the views is theirs to report)."""
        own = sum(v.pending_prefill_tokens for v in self.replicas.values()) - self.budget.sibling_prefill_total()
        return own + self.queued_prefill_tokens()

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, now: float) -> list[tuple[RoutingRequest, Decision]]:
        """Place as many queued requests as available replicas allow, in queue order
        (priority, then the discipline's order within one; arrival order without one).

        Looks up to ``lookahead`` requests past held ones so that one request waiting for
        its cache-affine replica does not block the rest (no head-of-line blocking).
        """
        if self.wants:
            self.wants = {}
        if not self._queue:
            return []
        if self.pair_rule is not None:  # roles that follow the load (skymesh/routing/pairing/elastic.py)
            planned = self.pair_rule.plan_roles(self._configured_roles, self.replicas, now)
            if planned is not None:
                self._apply_roles(planned)
        self.budget.expire(now)  # a lease that ended since the last step
        if now - self._last_rebalance >= self.rebalance_interval_s:
            self._last_rebalance = now
            self.migrations = self.policy.rebalance(self.queued_requests(), self.replicas, now)
            self.counters.migrated += len(self.migrations)
        if self.discipline is not None:
            order = self.discipline.dispatch_order(self._queue, self.replicas, self._free_slots(), now,
                                                   self._excluded)
        else:
            order = self._queue.ids()
        placed: list[tuple[RoutingRequest, Decision]] = []
        held = 0
        wanted = 0
        for rid in order:
            if held >= self.lookahead or not self.any_available():
                break
            q = self._queue[rid]
            views = self._views_for(q)
            # every replica's views: some is available (the loop's test)
            if views is not self.replicas and not any(v.available for v in views.values()):
                held += 1
                continue
            decision = self.policy.choose(q.req, views, now)
            if decision.replica_id is None:
                held += 1
                continue
            target = views.get(decision.replica_id)
            if target is None or not target.available:
                # A policy must only pick available replicas; guard the invariant rather
                # than overfill a busy replica.
                raise RuntimeError(
                    f"policy {self.policy.name!r} chose unavailable replica {decision.replica_id!r}"
                )
            if self.pair_rule is not None:
                paired = self._pair(q, decision, now)
                if paired is None:  # no replica can decode it now: it waits
                    held += 1
                    continue
                if isinstance(paired, PairChoice):  # refused: no placement meets its targets
                    self._dequeue(rid)
                    self.counters.refused_by_pair_rule += 1
                    self.refused.append((q.req, paired))
                    continue
                decision = paired
            if self.budget.awaits_lease(decision.replica_id):
                # free region-wide, not here: the unit's home leases it in its next message
                # (the want says so); the request keeps its cache-affine pick meanwhile
                # (sending it to a replica held here instead cost a third of the hit rate
                # and 11% of the SLO attainment with 3 balancers: docs/benchmarks.md)
                self.wants[decision.replica_id] = self.wants.get(decision.replica_id, 0) + 1
                held += 1
                wanted += 1
                if wanted >= WANT_LOOKAHEAD:
                    break
                continue
            self._dequeue(rid)
            self._commit(q, decision, now)
            placed.append((q.req, decision))
        return placed

    def _free_slots(self) -> dict[str, int]:
        """Per available replica, the requests this balancer can still send it before its
        next probe."""
        return {rid: slots for rid, v in self.replicas.items() if v.available and (slots := self.budget.free_slots(rid)) > 0}

    def _excluded(self, request_id: str) -> AbstractSet[str]:
        """The replicas a queued request may not run on (the discipline's question)."""
        q = self._queue.get(request_id)
        return frozenset() if q is None else self._disallowed(q)

    def _disallowed(self, q: _Queued | _InFlight) -> AbstractSet[str]:
        # a retried request never goes back to a replica that already failed it, and no
        # request runs where the operator's residency rules forbid it
        if self.forbidden_for is not None:
            forbidden = self.forbidden_for(q.req)
            if forbidden:
                return q.excluded | forbidden
        return q.excluded

    def _dequeue(self, request_id: str) -> _Queued | None:
        q = self._queue.pop(request_id)
        if q is None:
            return None
        self._queued_prompt_tokens -= q.req.prompt_tokens
        if self.discipline is not None:
            self.discipline.on_dequeued(request_id)
        return q

    def _views_for(self, q: _Queued) -> dict[str, ReplicaView]:
        """The replicas the policy may pick for ``q``: allowed, and not decode-only."""
        excluded = self._disallowed(q)
        if self._decode_only:
            excluded = excluded | self._decode_only
        if not excluded:
            return self.replicas
        return {k: v for k, v in self.replicas.items() if k not in excluded}

    def _pair(self, q: _Queued, decision: Decision, now: float) -> Decision | PairChoice | None:
        """The pair rule's word on the policy's pick: whole there, whole on another
        replica that may take it now, split (prefill there, decode elsewhere), or refused
        (the rule's choice, ``refused``)."""
        assert self.pair_rule is not None
        # a draining replica takes no new leg either
        excluded = self._disallowed(q) | self.draining
        choice = self.pair_rule.choose(q.req, decision, self.replicas, self.roles, excluded, now)
        if choice is None or choice.refused:
            return choice
        p = choice.prefill_replica_id
        if p != decision.replica_id:
            view = self.replicas.get(p)
            if view is None or not view.available or p in excluded:
                raise RuntimeError(f"pair rule {self.pair_rule.name!r} moved a request to unavailable replica {p!r}")
        elif choice.decode_replica_id is None:
            return decision
        return Decision(p, decision.reason if p == decision.replica_id else choice.reason,
                        choice.matched_tokens, choice.predicted_ttft_s, decode_replica_id=choice.decode_replica_id,
                        transfer_s=choice.transfer_s)

    def take_refused(self) -> list[tuple[RoutingRequest, PairChoice]]:
        """The requests the pair rule refused since the last call (they left the queue)."""
        refused, self.refused = self.refused, []
        return refused

    def has_allowed_available(self, req: RoutingRequest) -> bool:
        """Some replica this queued request may run on is available now."""
        q = self._queue.get(req.request_id)
        views = self._views_for(q) if q is not None else self.replicas
        return any(v.available for v in views.values())

    def _commit(self, q: _Queued, decision: Decision, now: float) -> None:
        rid = decision.replica_id
        assert rid is not None
        view = self.replicas[rid]
        prefill = max(0, q.req.prompt_tokens - decision.matched_tokens)
        view.pending_prefill_tokens += prefill
        view.in_flight += 1
        if self.pair_rule is not None:
            view.add_prefill(prefill, now)
        self.budget.pushed(rid, now)
        self._refresh_available(view)
        f = self._in_flight[q.req.request_id] = _InFlight(
            req=q.req,
            replica_id=rid,
            dispatched_at=now,
            prefill_tokens=prefill,
            excluded=q.excluded,
        )
        d = decision.decode_replica_id
        if d is not None:
            f.leg = PREFILL_LEG
            f.transfer_s = decision.transfer_s
            self._book_decode(f, d)
        self.counters.dispatched += 1
        if decision.reason == "spill":
            self.counters.spilled += 1
        self.dispatches_per_replica[rid] = self.dispatches_per_replica.get(rid, 0) + 1
        if self.discipline is not None:
            self.discipline.on_dispatch(q.req, rid, now)
        self.policy.on_dispatch(q.req, rid, now)
        if self.record_dispatch is not None:
            self.record_dispatch(q.req, rid, now)
            if d is not None:  # the decode replica holds the prompt's KV once moved
                self.record_dispatch(q.req, d, now)

    def take_for_offload(self, request_ids: Iterable[str]) -> list[RoutingRequest]:
        """Remove queued requests that the region layer forwards to a peer balancer."""
        out = []
        for rid in request_ids:
            q = self._dequeue(rid)
            if q is not None:
                out.append(q.req)
                self.counters.offloaded += 1
        return out

    # ------------------------------------------------------------------ request lifecycle

    def on_first_token(self, request_id: str, now: float, observe: bool = True) -> float | None:
        """Returns the TTFT seen from the balancer (dispatch → first token).

        ``observe=False`` when the first byte is not the first token (a non-streaming
        response arrives whole), so the policy's TTFT model is not fed end-to-end times.
        """
        f = self._in_flight.get(request_id)
        if f is None or f.first_token_at is not None or f.leg == PREFILL_LEG:
            return None
        f.first_token_at = now
        if f.leg == DECODE_LEG:
            # the decode leg started: its booking there is the replica's own figures now
            self._unbook_decode(f)
            return now - f.dispatched_at
        view = self.replicas.get(f.replica_id)
        if view is not None:
            view.pending_prefill_tokens -= f.prefill_tokens
            # the replica admitted it: its unit of dispatch budget comes back early
            self.budget.unit_back(f.replica_id, f.dispatched_at)
            self._refresh_available(view)
        else:
            self.budget.forget_unstarted(f.replica_id, f.dispatched_at)
        ttft = now - f.dispatched_at
        if observe:
            self.policy.on_first_token(f.req, f.replica_id, ttft, now)
        return ttft

    def on_prefill_done(self, request_id: str, now: float) -> str | None:
        """A split request's prefill leg answered (its KV is ready to move): the prefill
        replica's booking ends as a whole request's would at its first token and its end
        (the policy observes the leg's time as a TTFT), and the request's leg is now its
        decode, on the replica returned (None: not a prefill leg in flight here)."""
        f = self._in_flight.get(request_id)
        if f is None or f.leg != PREFILL_LEG or f.decode_replica_id is None:
            return None
        f.leg = WHOLE
        self.on_first_token(request_id, now)
        view = self.replicas.get(f.replica_id)
        if view is not None:
            view.in_flight -= 1
            self._refresh_available(view)
        self.policy.on_complete(f.req, f.replica_id, True, now)
        f.prefill_replica_id = f.replica_id
        f.leg, f.replica_id, f.first_token_at, f.prefill_tokens = DECODE_LEG, f.decode_replica_id, None, 0
        d = f.replica_id
        view = self.replicas.get(d)
        if view is None or not view.healthy or d in self.draining:
            # the decode replica chosen at placement left, was ejected or is draining while
            # the prefill ran: another for the KV now ready (kept when there is none: the
            # attempt there fails and the request is placed again)
            self._move_decode(f, now)
        return f.replica_id

    def transfer_estimate_s(self, request_id: str) -> float:
        """A split request's KV move to its current decode replica, as the pair rule
        estimated it (0: not a split request in flight)."""
        f = self._in_flight.get(request_id)
        return 0.0 if f is None else f.transfer_s

    def place_decode_again(self, request_id: str, now: float) -> Decision | None:
        """A split request's decode leg failed before its first token while its prefill's
        KV is held: the pair rule places the leg on another decode replica (the failed one
        held until its next probe, as after a retry), which reads that KV instead of the
        request being prefilled again. None: not such a leg, or no other replica may
        decode it (the caller queues the request again)."""
        f = self._in_flight.get(request_id)
        if f is None or f.leg != DECODE_LEG or f.first_token_at is not None:
            return None
        failed = f.replica_id
        if not self._move_decode(f, now):
            return None
        f.excluded.add(failed)
        self.hold(failed)
        self.counters.retried += 1
        return Decision(f.replica_id, "its decode leg again", decode_leg=True, transfer_s=f.transfer_s)

    def _move_decode(self, f: _InFlight, now: float) -> bool:
        """``f``'s decode leg to the replica the pair rule picks for the KV on its prefill
        replica, its current decode replica excluded (False: none, nothing changed)."""
        prefill = f.prefill_replica_id
        if self.pair_rule is None or prefill is None:
            return False
        excluded = self._disallowed(f) | self.draining | {f.replica_id}
        choice = self.pair_rule.choose(f.req, Decision(prefill, "prefill done"), self.replicas, self.roles, excluded,
                                       now)
        if (choice is None or choice.refused or choice.decode_replica_id is None
                or choice.prefill_replica_id != prefill):
            return False
        self._unbook_decode(f)
        f.replica_id = choice.decode_replica_id
        f.transfer_s = choice.transfer_s
        self._book_decode(f, choice.decode_replica_id)
        return True

    def _book_decode(self, f: _InFlight, decode_replica_id: str) -> None:
        """``f``'s decode leg goes to ``decode_replica_id``: its KV tokens (prompt and
        output) are booked there until the leg's first token."""
        f.decode_replica_id = decode_replica_id
        f.decode_tokens = f.req.prompt_tokens + f.req.max_tokens
        view = self.replicas[decode_replica_id]
        view.pending_decodes += 1
        view.pending_decode_tokens += f.decode_tokens

    def _unbook_decode(self, f: _InFlight) -> None:
        if f.decode_tokens == 0 or f.decode_replica_id is None:
            return
        view = self.replicas.get(f.decode_replica_id)
        if view is not None:
            view.pending_decodes -= 1
            view.pending_decode_tokens -= f.decode_tokens
        f.decode_tokens = 0

    def on_complete(self, request_id: str, ok: bool, now: float) -> None:
        f = self._in_flight.pop(request_id, None)
        if f is None:
            return
        self._release(f)
        if ok:
            self.counters.completed += 1
        else:
            self.counters.failed += 1
        if f.leg != DECODE_LEG:  # a decode leg's prefill replica was released at its end
            self.policy.on_complete(f.req, f.replica_id, ok, now)

    def give_up(self, request_id: str, now: float) -> None:
        """The attempt failed before the first byte and the request has no placement left
        (the region core's retry budget): it failed, and its replica is held as after a
        retry, until the next probe says otherwise."""
        f = self._in_flight.get(request_id)
        self.on_complete(request_id, False, now)
        if f is not None:
            self.hold(f.replica_id)

    def retry(self, request_id: str, now: float) -> bool:
        """The attempt ended before the first byte (it failed, or the region core abandoned
        it): queue again at the head, never to the same replica. Whether the request may
        have another placement is the region core's call (its one retry budget,
        ``RegionSettings.max_retries``). False: it was not in flight here."""
        f = self._in_flight.pop(request_id, None)
        if f is None:
            return False
        self._release(f)
        if f.leg != DECODE_LEG:
            self.policy.on_complete(f.req, f.replica_id, False, now)
        # stop sending there until the next probe says otherwise (whether the replica is
        # ejected is the region core's health tracker's call, with hysteresis)
        self.hold(f.replica_id)
        q = _Queued(f.req, excluded=f.excluded | {f.replica_id})
        self._queue.push(request_id, q, f.req.priority, front=True)
        self._queued_prompt_tokens += f.req.prompt_tokens
        if self.discipline is not None:
            self.discipline.on_queued(f.req)
        self.counters.retried += 1
        return True

    def cancel(self, request_id: str, now: float) -> None:
        """The client went away: forget the request wherever it is."""
        if self._dequeue(request_id) is not None:
            return
        self.on_complete(request_id, False, now)

    def _release(self, f: _InFlight) -> None:
        self._unbook_decode(f)
        if f.leg == DECODE_LEG:
            return  # its prefill replica was released when its prefill leg answered
        view = self.replicas.get(f.replica_id)
        if view is None:
            return
        view.in_flight -= 1
        if f.first_token_at is None:
            view.pending_prefill_tokens -= f.prefill_tokens
            # it left before its first token gave the budget back: give it back now
            self.budget.unit_back(f.replica_id, f.dispatched_at)
        self._refresh_available(view)

    # ------------------------------------------------------------------ introspection

    def snapshot(self) -> dict[str, Any]:
        return {
            "queue_length": len(self._queue),
            "in_flight": len(self._in_flight),
            "replicas": {
                rid: {
                    "healthy": v.healthy,
                    "available": v.available,
                    "num_running": v.num_running,
                    "num_waiting": v.num_waiting,
                    "kv_cache_usage": v.kv_usage,
                    "pending_prefill_tokens": self.own_pending_prefill(rid),
                    **({"region_pending_prefill_tokens": v.pending_prefill_tokens} if self.budget.shared else {}),
                    "in_flight": v.in_flight,
                    "role": self.role_of(rid),
                    **({"pending_decodes": v.pending_decodes} if rid in self.roles else {}),
                    "dispatched": self.dispatches_per_replica.get(rid, 0),
                }
                for rid, v in self.replicas.items()
            },
            "counters": {k: getattr(self.counters, k) for k in self.counters.__slots__},
            "policy": {"name": self.policy.name, **self.policy.stats()},
            # the queue discipline's own counters (absent for fcfs)
            **({"discipline": self.discipline.stats()} if self.discipline is not None else {}),
        }
