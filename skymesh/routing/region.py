"""One region's decisions, pure: events in, actions out.

:class:`RegionCore` is the request lifecycle coordinator of a regional balancer. The
daemon (real sockets, real clock) and the discrete-event simulator both drive only this
object: they report what happened (``submit``, ``probe``, ``peer_heartbeat``,
``first_token``, ``complete``, ``fail``, ``client_gone``, ``peer_down``, ``tick``) and
carry out the actions it returns (:mod:`skymesh.routing.region_actions`). It owns every
accepted request's state (:mod:`skymesh.routing.request_state`: each move checked and
counted in :attr:`RegionCore.transitions`; leaving ``placed``/``streaming`` releases the
replica booking in exactly one place, :meth:`RegionCore._leave`) and asks its parts for
every decision: the queue and the policy (:class:`~skymesh.routing.dispatcher.BalancerCore`),
admission (:mod:`skymesh.routing.admission`), replica health
(:class:`~skymesh.routing.health.ReplicaHealth`), the queue's service rate
(:class:`~skymesh.routing.drain_rate.DrainRate`), which queued requests go to a peer
(:class:`~skymesh.routing.offload_selection.OffloadSelection`, over
:class:`~skymesh.routing.offload.OffloadRouter`) and queue-wait deadlines
(:class:`~skymesh.routing.queue_deadlines.QueueDeadlines`). One concern, the coordinator:
every move of a request passes here, the decisions are its parts'. What it knows is read
through :attr:`RegionCore.view` (:class:`~skymesh.routing.region_read_view.RegionReadView`, the
read side: the daemon, the simulator, /admin/status, the heartbeat and the metrics read
it), which changes nothing; the core keeps the events and the request lifecycle.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from skymesh.routing.admission.base import AdmissionRule, first_refusal
from skymesh.routing.admission.region_view import RegionPartsView
from skymesh.routing.admission.rules import admission_rules
from skymesh.routing.base import Policy, RoutingRequest
from skymesh.routing.disciplines.base import DisciplineContext
from skymesh.routing.dispatcher import BalancerCore, QueueFull
from skymesh.routing.drain_rate import DrainRate
from skymesh.routing.harm import HARMFUL_REQUEST_CODE, SHARED_FAILURE_S, Harm, HeldRequest, suspect
from skymesh.routing.health import HealthChange, ProbeSample, ReplicaHealth
from skymesh.routing.heartbeat import HeartbeatSnapshot
from skymesh.routing.kv_index import KvEvent
from skymesh.routing.model import RegionModel
from skymesh.routing.offload import OffloadRouter, OffloadTrigger
from skymesh.routing.offload_selection import OffloadSelection
from skymesh.routing.pairing.base import PairChoice, Role
from skymesh.routing.queue_deadlines import QueueDeadlines
from skymesh.routing.queue_registry import make_discipline
from skymesh.routing.region_actions import (
    AbandonAttempt,
    Action,
    ForwardToRegion,
    Reject,
    SendToReplica,
)
from skymesh.routing.region_read_view import RegionReadView
from skymesh.routing.region_settings import RegionSettings
from skymesh.routing.request_state import ALLOWED_TRANSITIONS, RequestState
from skymesh.routing.residency import Residency
from skymesh.routing.siblings import RegionSiblings, SiblingMessage


@dataclass(slots=True)
class _Tracked:
    req: RoutingRequest
    state: RequestState
    target: str = ""  # replica id or peer region while placed/streaming
    on_peer: bool = False
    placements: int = 0
    # when it gets 504 if still queued: arrival + max wait, renewed when it is queued
    # again after a failed attempt (a client that got nothing waits one bound per queueing)
    queue_deadline: float = float("inf")


class RegionCore:
    """One region's request lifecycle: accepts events, asks its parts, returns actions.
    Its read side is :attr:`view`."""

    def __init__(
        self,
        region: str,
        policy: Policy,
        offload: OffloadRouter,
        settings: RegionSettings | None = None,
        model: RegionModel | None = None,
    ) -> None:
        self.region = region
        # the region's cost model and CacheView, shared by the policy (built on it:
        # PolicyContext.model), offload and the queue discipline; without one, a model
        # seeded as offload is (the policy then keeps its own)
        self.model = model if model is not None else RegionModel(
            chunk_tokens=offload.chunk_tokens, prefill_s_per_token=offload.seed_prefill_s_per_token,
            first_token_fixed_s=offload.seed_first_token_fixed_s)
        # the replicas' KV-event indexes (the ones the model's CacheView reads)
        self.kv_indexes = self.model.kv_indexes
        s = settings or RegionSettings()
        self.local = BalancerCore(
            policy,
            queue_bound=s.queue_bound,
            dispatch_budget=s.dispatch_budget,
            lookahead=s.lookahead,
            rebalance_interval_s=s.rebalance_interval_s,
        )
        # the only writer of the replicas' health flags (skymesh/routing/health.py)
        self.health = ReplicaHealth(self.local, s.health)
        self.settings = s
        self.offload = offload
        # offload prices prefill by the region's cost model (refitted where the policy learns)
        offload.use_model(self.model)
        self._requests: dict[str, _Tracked] = {}
        # replica -> when it last failed under requests none of which was blamed (harm.py)
        self._unblamed_failure_at: dict[str, float] = {}
        # each queued request's 504 time (arrival + max wait), skipped once it moved on
        self._deadlines = QueueDeadlines()
        self.transitions: Counter[tuple[str, str]] = Counter()
        # which replicas each request may run on (by home region and the offload rules)
        self.residency = Residency(region, offload, self.health)
        # queued requests per origin region (those that name one: forwarded by a peer, or a
        # failover's clients)
        self._queued_from: Counter[str] = Counter()
        # the queue's service rate, fed every placement here and the end of every backlog
        self.drain_rate = DrainRate(self.local, offload)
        # which queued requests go to a peer, by either offload trigger
        self.offload_selection = OffloadSelection(self.local, self.drain_rate, offload,
                                                  self.residency.forbidden_replicas)
        self.local.forbidden_for = self.residency.forbidden_replicas
        # each dispatch goes into the model's routing history once, after the policy and the
        # discipline were told of it (a policy built on a model of its own records its own)
        self.local.record_dispatch = self.model.record_dispatch
        # prefill priced and caches read by the region's model, as the policy and offload do
        self.local.discipline = make_discipline(s.queue_discipline, s.queue_settings(),
                                                DisciplineContext(model=self.model, default_slo_s=s.ttft_slo_s))
        self.offloaded_out = 0
        self.offloaded_in = 0
        self._admission_view = RegionPartsView(self.local, self.drain_rate, self.offload_selection, offload,
                                               self.residency)
        # the region's other balancers (None: this balancer is the region's only one)
        self.siblings: RegionSiblings | None = None
        # the read side (daemon, simulator, /admin/status, heartbeat, metrics): reads the
        # parts above live, siblings as attached at the moment it is asked
        self.view = RegionReadView(self.local, self.health, self.drain_rate, self.offload_selection,
                                   self._requests, self.transitions, lambda: self.siblings)

    def attach_siblings(self, siblings: RegionSiblings) -> None:
        """This balancer is one of several in its region: it shares each replica's push
        budget with them, reads the replicas' pages net of their requests, and tells them
        what it places (docs/routing.md, "A region is a fleet")."""
        self.siblings = siblings
        siblings.shares.set_replicas(self.local.replicas)
        self.local.budget.attach_siblings(siblings)
        record = self.model.record_dispatch

        def record_and_tell(req: RoutingRequest, replica_id: str, now: float) -> None:
            record(req, replica_id, now)
            siblings.placed(replica_id, req.chunk_hashes, now)

        self.local.record_dispatch = record_and_tell
        self.local.refresh_budgets()

    def sibling_message(self, now: float) -> SiblingMessage:
        """What this balancer tells its siblings now (call every sibling interval)."""
        sib = self._require_siblings()
        self._sibling_step(now)
        return SiblingMessage(
            region=self.region,
            shares=sib.shares.message(self.local.queue_length, self.local.wants, now),
            sent_at=now,
            pending_prefill_tokens=max(0, self.local.pending_prefill_tokens()),
            placements_per_s=self.view.offload_rate_per_s(now) or 0.0,
            loads=self.local.loads(),
            placements=sib.take_placements(),
        )

    def sibling_state(self, msg: SiblingMessage, now: float) -> bool:
        """A sibling's message: its placements go into the routing history (so the
        policy here knows what it sent where), its units and loads into the push budget.
        False: ignored (another region's, or older than one heard)."""
        sib = self._require_siblings()
        if not sib.heard(msg, now):
            return False
        known = self.local.replicas
        for p in msg.placements:
            if p.replica_id in known:
                self.model.cache.insert(p.chunk_hashes, p.replica_id)
                sib.placements_applied += 1
        self._sibling_step(now)
        return True

    def _require_siblings(self) -> RegionSiblings:
        if self.siblings is None:
            raise RuntimeError("this region core has no siblings attached (attach_siblings)")
        return self.siblings

    def _sibling_step(self, now: float) -> None:
        if self.siblings is not None:
            self.siblings.step(now, self.local.budget.unseen_pushes(), self.local.wants)
            self.local.refresh_budgets()

    @property
    def settings(self) -> RegionSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: RegionSettings) -> None:
        """New settings rebuild the admission list (skymesh/routing/admission/rules.py) and
        give the health part its thresholds."""
        self._settings = settings
        self._admission = admission_rules(settings)
        self.health.settings = settings.health

    @property
    def admission(self) -> tuple[AdmissionRule, ...]:
        """The admission rules :meth:`submit` checks, in order."""
        return self._admission

    # ------------------------------------------------------------------ lifecycle core

    def _move(self, t: _Tracked, to: RequestState) -> None:
        frm = t.state
        if to not in ALLOWED_TRANSITIONS.get(frm, frozenset()):
            raise RuntimeError(f"request {t.req.request_id}: illegal transition {frm} -> {to}")
        t.state = to
        self.transitions[(str(frm), str(to))] += 1
        if t.req.origin_region is not None:
            self._queued_from[t.req.origin_region] += (to is RequestState.QUEUED) - (frm is RequestState.QUEUED)

    def _leave(self, t: _Tracked, to: RequestState, now: float) -> None:
        """The one place a request leaves the core: release what was booked for it."""
        rid = t.req.request_id
        if t.state is RequestState.QUEUED:
            self.local.cancel(rid, now)  # drops the queue slot
            self.drain_rate.end_backlog_if_drained()
        elif not t.on_peer and self.local.is_in_flight(rid):
            self.local.on_complete(rid, to is RequestState.DONE, now)
        self._move(t, to)
        del self._requests[rid]

    def _queue_again(self, t: _Tracked, now: float) -> None:
        """``t``'s attempt ended before any byte reached its client and it is back in the
        queue: it waits under a new queue-wait deadline from ``now``."""
        self._move(t, RequestState.QUEUED)
        t.target, t.on_peer = "", False
        self._arm_deadline(t, now)

    def _arm_deadline(self, t: _Tracked, since: float) -> None:
        if self.settings.max_queue_wait_s is None:
            return
        t.queue_deadline = since + self.settings.max_queue_wait_s
        self._deadlines.arm(t.req.request_id, t.queue_deadline)

    def reconfigure(
        self,
        settings: RegionSettings,
        *,
        allowed: Callable[[str, str], bool],
        max_remote_queue: int,
        miss_limit: int,
        trigger: OffloadTrigger | None = None,
        min_gain_s: float | None = None,
    ) -> None:
        """New settings and offload rules (a config reload). Nothing already decided moves:
        requests placed or streaming keep their replica or peer, queued ones keep their
        place and their queue-wait deadline. Every decision from now on uses the new
        values: admission (queue bound, wait bound), retries, health thresholds, and each
        placement, queued requests included, is checked against the new residency rules
        (``allowed(origin, region)``)."""
        self.settings = settings
        local = self.local
        local.queue_bound = settings.queue_bound
        local.dispatch_budget = settings.dispatch_budget
        local.lookahead = settings.lookahead
        local.rebalance_interval_s = settings.rebalance_interval_s
        self.offload.reconfigure(allowed=allowed, max_remote_queue=max_remote_queue, miss_limit=miss_limit,
                                 trigger=trigger, min_gain_s=min_gain_s)
        self.residency.rules_changed()

    # ------------------------------------------------------------------ events in

    def set_replicas(
        self, replica_ids: Sequence[str], now: float, homes: Mapping[str, str] | None = None
    ) -> list[Action]:
        """Membership changed (YAML or the controller). Requests placed on a replica that
        left and not yet streaming go back to the head of the queue at once. ``homes``:
        replica id -> the region it lives in, when not this one (replicas adopted from a
        failed region): residency rules then decide, per request origin, where it may run."""
        self.residency.set_homes(replica_ids, homes)
        wanted = set(replica_ids)
        actions: list[Action] = []
        for rid in list(self.local.replicas):
            if rid not in wanted:
                actions.extend(self._abandon_unstarted(rid, now, "replica left membership"))
                self.health.forget(rid)
                self._unblamed_failure_at.pop(rid, None)
                if self.kv_indexes is not None:
                    self.kv_indexes.forget(rid)
        self.local.set_replicas(replica_ids)
        if self.siblings is not None:
            self.siblings.shares.set_replicas(replica_ids)
            self.local.refresh_budgets()
        self.health.track(replica_ids)
        return actions

    def set_draining(self, replica_ids: Sequence[str]) -> None:
        """Members leaving (the controller's topology marks them draining): no new
        dispatch to them; requests in flight on them finish there."""
        self.local.set_draining(replica_ids)

    def kv_events(self, replica_id: str, events: Sequence[KvEvent], now: float,
                  max_blocks: int | None = None) -> None:
        """A replica's KV events (a decoded batch, in sequence order; the subscriber has
        replayed any gap it could). From the first batch on, the policy reads this
        replica's cache from its index instead of the routing history."""
        if self.kv_indexes is None or replica_id not in self.local.replicas:
            return
        idx = self.kv_indexes.index(replica_id, max_blocks)
        idx.in_step = True
        stored = idx.apply(events, now)
        if stored and self.local.discipline is not None:
            self.local.discipline.on_cached(replica_id, stored)

    def kv_stream_reset(self, replica_id: str) -> None:
        """The replica's event stream started over (its sequence went back: a restarted
        vLLM, whose cache is empty): the index starts over too."""
        if self.kv_indexes is not None:
            idx = self.kv_indexes.by_replica.get(replica_id)
            if idx is not None:
                idx.clear()

    def submit(self, req: RoutingRequest, now: float, *, front: bool = False) -> list[Action]:
        if req.request_id in self._requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        t = _Tracked(req, RequestState.QUEUED)
        self.drain_rate.end_backlog_if_drained()
        refusal = first_refusal(self._admission, req, now, self._admission_view)
        if refusal is not None:
            self.transitions[("new", str(RequestState.REJECTED))] += 1
            return [Reject(req.request_id, refusal.status, refusal.code, refusal.message, refusal.retry_after_s)]
        try:
            self.local.submit(req, front=front)
        except QueueFull as e:
            self.transitions[("new", str(RequestState.REJECTED))] += 1
            return [Reject(req.request_id, 429, "queue_full", str(e), self.settings.retry_after_s)]
        self.transitions[("new", str(RequestState.QUEUED))] += 1
        self._requests[req.request_id] = t
        if req.origin_region is not None:
            self._queued_from[req.origin_region] += 1
        if req.forwarded:
            self.offloaded_in += 1
        self._arm_deadline(t, req.arrival)
        return []

    def probe(self, replica_id: str, sample: ProbeSample | None, now: float, *, stalled: bool = False) -> list[Action]:
        """A probe result: ``sample`` None when the scrape failed or made no sense;
        ``stalled``: it failed by timing out (the replica went silent, which a request's
        work can cause: an ejection then judges the suspect, skymesh/routing/harm.py)."""
        if self.health.probed(replica_id, sample) is HealthChange.EJECTED:
            return self._abandon_unstarted(replica_id, now, harm=Harm.STALL if stalled else None)
        return []

    def _abandon_unstarted(self, replica_id: str, now: float, why: str = "replica ejected",
                           harm: Harm | None = None) -> list[Action]:
        actions: list[Action] = []
        blamed = None if harm is None else self._blamed(replica_id, harm, now)
        for request_id in self.local.unstarted_on(replica_id):
            t = self._requests.get(request_id)
            if t is None or t.state is not RequestState.PLACED:
                continue
            if request_id == blamed:
                self._leave(t, RequestState.REJECTED, now)
                self.health.readmit_on_next_probe(replica_id)
                actions += [AbandonAttempt(request_id, replica_id),
                            self._harmful(request_id, replica_id, "its probes timed out until it was ejected")]
                continue
            if self._budget_spent(t):
                self._leave(t, RequestState.REJECTED, now)
                actions += [AbandonAttempt(request_id, replica_id), self._exhausted(request_id, why)]
                continue
            self.local.retry(request_id, now)
            self._queue_again(t, now)
            actions.append(AbandonAttempt(request_id, replica_id))
        return actions

    def _budget_spent(self, t: _Tracked) -> bool:
        """The one retry budget: ``max_retries`` placements after the first, however the
        last one ended (failed, or abandoned by this region)."""
        return t.placements > self.settings.max_retries

    def _blamed(self, replica_id: str, harm: Harm, now: float) -> str | None:
        """The request a failure of ``replica_id`` of kind ``harm`` is judged against."""
        held = [HeldRequest(t.req.request_id, t.req.prompt_tokens, t.state is RequestState.STREAMING)
                for t in self._requests.values()
                if not t.on_peer and t.target == replica_id
                and t.state in (RequestState.PLACED, RequestState.STREAMING)]
        last = self._unblamed_failure_at.get(replica_id)
        blamed = suspect(held, harm, shared=last is not None and now - last <= SHARED_FAILURE_S)
        if blamed is None:
            self._note_unblamed_failure(replica_id, now)
        return blamed

    def _note_unblamed_failure(self, replica_id: str, now: float) -> None:
        """``replica_id`` failed under requests none of which is blamed (a mid-stream
        failure, one no request causes, or a disconnect judged shared): a disconnect told
        to another of its requests within ``SHARED_FAILURE_S`` is that same failure, not
        one the request caused alone (skymesh/routing/harm.py)."""
        self._unblamed_failure_at[replica_id] = now

    @staticmethod
    def _harmful(request_id: str, replica_id: str, reason: str) -> Reject:
        return Reject(request_id, 502, HARMFUL_REQUEST_CODE,
                      f"replica {replica_id} failed while it held this request ({reason}); the request is not "
                      "tried on another replica, since it may be what made this one fail")

    @staticmethod
    def _exhausted(request_id: str, reason: str) -> Reject:
        return Reject(request_id, 502, "upstream_unavailable",
                      f"all attempts to reach a replica failed before any output ({reason})")

    def peer_heartbeat(
        self, region: str, snapshot: HeartbeatSnapshot, now: float, *,
        balancer_id: str = "", epoch: int = 0, seq: int = 0,
    ) -> bool:
        return self.offload.update_peer(
            region,
            now=now,
            balancer_id=balancer_id,
            epoch=epoch,
            seq=seq,
            replicas_total=snapshot.replicas_total,
            replicas_available=snapshot.replicas_available,
            queue_length=snapshot.queue_length,
            pending_prefill_tokens=snapshot.pending_prefill_tokens,
            placements_per_s=snapshot.placements_per_s,
        )

    def peer_down(self, region: str, now: float, *, cut_forwards: bool = True) -> list[Action]:
        """Peer region ``region`` is dead: its heartbeats timed out (``tick`` notices), the
        heartbeat stream this balancer dialed broke, or the controller declared its
        balancer dead. Nothing waits for it any longer, at this ``now``:

        - a forward to it that has returned nothing to the client yet is cut
          (:class:`AbandonAttempt`) and queued again at the head, like a failed attempt
          (one that streamed to the client already is left to end on its own: its bytes
          cannot be taken back);
        - every queued request that could have gone there is decided again: it stays
          queued where a replica it may use here is healthy (or not yet probed) or another
          region its residency allows is alive, else it gets 503 with Retry-After now.

        ``cut_forwards`` False (the controller's word: a balancer it lost may be draining,
        and finishes what it holds) leaves the forwards in flight to end on their own; one
        that fails before any output is decided by the same rule in :meth:`fail`.

        The peer is no target until its next heartbeat. Idempotent: a peer already down
        (or never heard from) changes nothing."""
        if not self.offload.mark_down(region):
            return []
        actions: list[Action] = []
        cut = [t for t in self._requests.values()
               if t.state is RequestState.PLACED and t.on_peer and t.target == region] if cut_forwards else []
        for t in cut:
            request_id = t.req.request_id
            if self._budget_spent(t):
                self._leave(t, RequestState.REJECTED, now)
                actions += [AbandonAttempt(request_id, region), self._exhausted(request_id, f"peer region {region} down")]
                continue
            try:
                self.local.submit(t.req, front=True)
            except QueueFull:
                self._leave(t, RequestState.REJECTED, now)
                actions += [AbandonAttempt(request_id, region),
                            Reject(request_id, 503, "no_capacity", f"peer region {region} went down and "
                                   "the queue here is full", self.settings.retry_after_s)]
                continue
            self._queue_again(t, now)
            actions.append(AbandonAttempt(request_id, region))
        actions.extend(self._decide_queued_again(region, now, "went down"))
        return actions

    def peer_returning(self, region: str, now: float, replicas: int) -> bool:
        """The controller says peer region ``region``'s balancer is back (alive again after
        a failover, or registered anew), owning ``replicas``, while this balancer has not
        heard from it yet: its heartbeat stream is being dialled again. Until its first
        heartbeat (at most ``offload.RETURN_GRACE_S``) a request only it may serve waits
        for it in the queue instead of being refused; then it is forwarded, or, when the
        grace runs out without a heartbeat, answered 503 (``tick``)."""
        return self.offload.expect(region, now, replicas)

    def _decide_queued_again(self, region: str, now: float, what: str) -> list[Action]:
        """Every queued request that could have gone to ``region`` (which ``what``): 503
        with Retry-After now where no replica it may use here is healthy (or unprobed) and
        no other region its residency allows is alive; the rest stay queued."""
        actions: list[Action] = []
        allowed = self.offload.allowed
        for request_id, t in list(self._requests.items()):
            req = t.req
            if (t.state is not RequestState.QUEUED or req.forwarded
                    or not allowed(req.origin_region or self.region, region)
                    or not self.residency.nothing_can_serve(req, now)):
                continue
            self._leave(t, RequestState.REJECTED, now)
            actions.append(Reject(request_id, 503, "no_capacity",
                                  f"peer region {region} {what} and no other replica or region that may "
                                  "serve this request is available", self.settings.retry_after_s))
        return actions

    def set_roles(self, roles: Mapping[str, Role]) -> None:
        """Each replica's prefill/decode role (missing: ``both``; skymesh/routing/pairing)."""
        self.local.set_roles(roles)
        self.residency.set_roles(roles)

    def prefill_done(self, request_id: str, now: float) -> str | None:
        """A split request's prefill leg answered with its KV ready to move: the request is
        now its decode leg's, on the replica returned, which the driver calls next with the
        prefill's transfer parameters (None: no such leg in flight; nothing changed)."""
        t = self._requests.get(request_id)
        if t is None or t.state is not RequestState.PLACED or t.on_peer:
            return None
        decode = self.local.on_prefill_done(request_id, now)
        if decode is not None:
            t.target = decode
        return decode

    def first_token(self, request_id: str, now: float, *, observe: bool = True) -> float | None:
        """The first byte of the answer reached the balancer (and is about to reach the
        client). Returns the dispatch → first-token time for a local replica."""
        t = self._requests.get(request_id)
        if t is None or t.state is not RequestState.PLACED:
            return None
        self._move(t, RequestState.STREAMING)
        if t.on_peer:
            return None
        return self.local.on_first_token(request_id, now, observe=observe)

    def complete(self, request_id: str, now: float) -> None:
        t = self._requests.get(request_id)
        if t is not None and t.state in (RequestState.PLACED, RequestState.STREAMING):
            self._leave(t, RequestState.DONE, now)

    def fail(self, request_id: str, now: float, *, reason: str, counts_against_health: bool = True,
             harm: Harm | None = None) -> list[Action]:
        """The attempt failed. Before the first byte the request is queued again (never on
        the same replica; a failed peer is skipped until its next heartbeat) unless its
        budget is spent, or ``harm`` (how a local replica failed, where a request can be
        its cause) judges it the suspect (skymesh/routing/harm.py): then it is answered
        502 and its replica returns on its next good probe; after the first byte, the
        request failed."""
        t = self._requests.get(request_id)
        if t is None:
            return []
        if t.state is RequestState.STREAMING:
            if not t.on_peer:
                # the replica failed under a request it had started answering, which is
                # not blamed
                self._note_unblamed_failure(t.target, now)
            self._leave(t, RequestState.FAILED, now)
            return []
        if t.state is not RequestState.PLACED:
            return []
        actions: list[Action] = []
        target = t.target
        exhausted = self._budget_spent(t)
        if t.on_peer:
            self.offload.mark_unavailable(target)
            if not exhausted and self.residency.nothing_can_serve(t.req, now):
                # its peer is down and nothing else it may use is left: say so now
                self._leave(t, RequestState.REJECTED, now)
                return [Reject(request_id, 503, "no_capacity",
                               f"peer region {target} failed ({reason}) and no other replica or region that "
                               "may serve this request is available", self.settings.retry_after_s)]
            if not exhausted:
                try:
                    self.local.submit(t.req, front=True)
                except QueueFull:
                    exhausted = True
        elif harm is not None and self._blamed(target, harm, now) == request_id:
            # a query of death: answered here, never carried to the next replica
            self.local.give_up(request_id, now)
            if counts_against_health and self.health.failed(target) is HealthChange.EJECTED:
                actions.extend(self._abandon_unstarted(target, now))
            self.health.readmit_on_next_probe(target)
            self._move(t, RequestState.REJECTED)
            del self._requests[request_id]
            actions.append(self._harmful(request_id, target, reason))
            return actions
        else:
            if harm is None and counts_against_health:
                # failed for a reason no request causes (refused, a 5xx, no first byte
                # in time): the replica was failing before any later disconnect
                self._note_unblamed_failure(target, now)
            # a split request's decode leg goes to another decode replica, which reads the
            # KV its prefill holds (under its lease) instead of it being prefilled again
            decode = None if exhausted else self.local.place_decode_again(request_id, now)
            if exhausted:
                self.local.give_up(request_id, now)
            elif decode is None:
                self.local.retry(request_id, now)
            if counts_against_health and self.health.failed(target) is HealthChange.EJECTED:
                actions.extend(self._abandon_unstarted(target, now))
            if decode is not None:
                assert decode.replica_id is not None
                t.target = decode.replica_id
                t.placements += 1
                actions.append(SendToReplica(request_id, decode.replica_id, decode))
                return actions
        if exhausted:
            self._move(t, RequestState.REJECTED)
            del self._requests[request_id]
            actions.append(self._exhausted(request_id, reason))
            return actions
        self._queue_again(t, now)
        return actions

    def client_gone(self, request_id: str, now: float) -> None:
        t = self._requests.get(request_id)
        if t is not None:
            self._leave(t, RequestState.CANCELLED, now)

    def tick(self, now: float) -> list[Action]:
        """Expire over-long waits, forward what a peer would answer sooner (the
        predicted-TTFT trigger), place what the replicas can take, offload the rest."""
        actions: list[Action] = self._expire(now)
        offload = self.offload
        for region in offload.newly_dead(now):
            # heartbeats timed out: the queued requests are decided again now; forwards in
            # flight are not cut on a late heartbeat alone (a busy link or host would cost
            # work already under way): a dead peer's connections break, and fail() decides
            # those at once
            actions.extend(self.peer_down(region, now, cut_forwards=False))
        for region in offload.lapsed_expectations(now):
            # said to be back by the controller, but no heartbeat came within the grace
            actions.extend(self._decide_queued_again(region, now, "was said to be back but was not heard from"))
        actions.extend(self._forward(self.offload_selection.predicted_ttft(now), now))
        for req, decision in self.local.dispatch(now):
            t = self._requests[req.request_id]
            self.drain_rate.placed(now)
            self._move(t, RequestState.PLACED)
            t.target, t.on_peer = decision.replica_id or "", False
            t.placements += 1
            offload.on_local_dispatch(req, now)
            actions.append(SendToReplica(req.request_id, t.target, decision))
        for req, choice in self.local.take_refused():
            actions.append(self._refuse_unmet(req, choice, now))
        # residency may close local replicas to some queued requests: those are offered
        # to peers even while the replicas look free
        restricted = self.residency.adopted or self._restricted_queued()
        actions.extend(self._forward(self.offload_selection.saturated(now, restricted), now))
        self.drain_rate.end_backlog_if_drained()
        return actions

    def _refuse_unmet(self, req: RoutingRequest, choice: PairChoice, now: float) -> Action:
        """Mooncake's rejection (Algorithm 1): the pair rule found no placement expected
        to meet the request's TTFT and TBT targets, so it is answered 429 now rather than
        served late; Retry-After is how far past its TTFT target the best one was."""
        self._leave(self._requests[req.request_id], RequestState.REJECTED, now)
        ttft, tbt = choice.predicted_ttft_s or 0.0, choice.predicted_tbt_s or 0.0
        ttft_target = req.slo_ttft_s if req.slo_ttft_s is not None else self.settings.ttft_slo_s
        where = (f"prefill on {choice.prefill_replica_id}, decode on {choice.decode_replica_id}"
                 if choice.split else f"whole on {choice.prefill_replica_id}")
        return Reject(req.request_id, 429, "slo_unreachable",
                      f"no replica pair is expected to meet this request's time to first token and time between "
                      f"tokens targets (at best {where}: {ttft:.2f} s to the first token, {tbt * 1000:.0f} ms "
                      "between tokens): not served", max(self.settings.retry_after_s, ttft - ttft_target))

    def _restricted_queued(self) -> bool:
        """Some queued request's origin has replicas here closed to it (residency). A
        request only because it names an origin (every peer's forward does: the sender's
        region) is not: counting those made any region holding a forward offer its own
        queue by SkyWalker's rule past the predicted-TTFT trigger (issue 36)."""
        closes = self.residency.closes_any_to
        return any(n > 0 and closes(origin) for origin, n in self._queued_from.items())

    def _forward(self, chosen: list[tuple[RoutingRequest, str]], now: float) -> list[Action]:
        if not chosen:
            return []
        self.local.take_for_offload(r.request_id for r, _ in chosen)
        actions: list[Action] = []
        for req, region in chosen:
            t = self._requests[req.request_id]
            self._move(t, RequestState.PLACED)
            t.target, t.on_peer = region, True
            t.placements += 1
            self.offloaded_out += 1
            actions.append(ForwardToRegion(req.request_id, region))
        return actions

    def _expire(self, now: float) -> list[Action]:
        """504 for every request still queued at its queue-wait deadline by ``now``."""
        out: list[Action] = []
        for deadline, request_id in self._deadlines.due(now):
            t = self._requests.get(request_id)
            # gone, being served, or queued again since (a newer entry holds its deadline)
            if t is None or t.state is not RequestState.QUEUED or t.queue_deadline != deadline:
                continue
            self._leave(t, RequestState.REJECTED, now)
            out.append(Reject(request_id, 504, "queue_timeout", "timed out waiting for a replica",
                              self.settings.retry_after_s))
        return out
