"""``elastic``: the conductor over roles that follow the load. vLLM's ``kv_both`` replicas
take either leg, so which of a region's ``both`` replicas take new prefill is the
balancer's to decide. Every ``interval_s`` the rule's :class:`RolePlan` sets k of them
decode-only for new work (no new prefill or whole request there; what runs there
finishes) and, while k > 0, the rest prefill-only (``others_prefill_only``; else they stay
``both``). Between plans :class:`~skymesh.routing.pairing.conductor.Conductor` places each
request on the roles of the moment, and the plan reads what its prices said:

- **Whether P/D pays** (k = 0 ↔ 1): the share of requests whose whole placement on the
  policy's pick was priced past the TBT target (its own prefill pool's chunks would
  stretch its decode). At ``enter_share`` or more the region splits (k = 1); with k > 0,
  after ``leave_windows`` decisions in a row under ``leave_share`` it steps k down
  towards aggregation.
- **How many decode replicas** (k ↔ k ± 1, within ``max_decode_share`` of the pool): one
  more when the decode replicas' KV (used, and booked for decode legs not yet started) is
  past ``raise_fill`` of their capacity, or after ``short_windows`` decisions in a row in
  which at least ``short_share`` of requests had no decode replica priced within the TBT
  target; one fewer after ``leave_windows`` decisions in a row in which the KV of k would
  fill k − 1 to under ``lower_fill`` and no request was short of one.

k moves by at most one per interval, and a decision waits for ``min_requests`` priced
requests (the window then starts again). A decode replica lost (unhealthy, gone, or
configured otherwise) is replaced at once, not at the next decision: the healthy ``both``
replica with the least prefill ahead takes its place, so requests never wait for a decode
side that is down while others could decode them. Replicas configured ``prefill`` or
``decode`` keep their role. Pure: ``now`` is passed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from skymesh.routing.pairing.base import PairChoice, PairContext, Role
from skymesh.routing.pairing.conductor import Conductor, ConductorOptions

if TYPE_CHECKING:
    from skymesh.routing.base import Decision, ReplicaView, RoutingRequest


@dataclass(frozen=True, slots=True)
class ElasticOptions(ConductorOptions):
    interval_s: float = 2.0  # how often the plan may move k
    min_requests: int = 10  # priced requests a decision needs
    # share of requests whose whole placement misses TBT that turns P/D on; under the
    # second, k steps down towards aggregation
    enter_share: float = 0.05
    leave_share: float = 0.01
    # consecutive decisions under leave_share (or with one decode replica too many)
    # before k steps down
    leave_windows: int = 5
    # the decode replicas' KV fill past which one more is added; one is released when the
    # rest would hold their KV under the second
    raise_fill: float = 0.85
    lower_fill: float = 0.5
    # share of requests with no decode replica priced within TBT that adds one
    short_share: float = 0.1
    # consecutive decisions that short before one more is added (a replica just set
    # decode-only still runs the prefill it was sent before)
    short_windows: int = 2
    max_decode_share: float = 0.5  # k <= this share of the replicas configured ``both``
    others_prefill_only: bool = True  # while k > 0, the other ``both`` replicas take no decode


@dataclass(slots=True)
class PlanWindow:
    """What the prices said since the last decision."""

    priced: int = 0
    seen: set[str] = field(default_factory=set)  # a request queued again is counted once
    whole_misses_tbt: int = 0  # whole on the policy's pick priced past the TBT target
    decode_short: int = 0  # no decode replica priced within the TBT target (or none at all)


class RolePlan:
    """Which ``both`` replicas are decode-only, and which prefill-only, for new work."""

    def __init__(self, options: ElasticOptions, kv_capacity_tokens: int) -> None:
        self.options = options
        self.kv_capacity_tokens = kv_capacity_tokens
        self.decode_ids: list[str] = []  # the replicas set decode-only, oldest first
        self.window = PlanWindow()
        self.decided_at: float | None = None
        self.quiet_windows = 0  # consecutive decisions whose whole-miss share was under leave_share
        # consecutive decisions where k - 1 decode replicas would have done (none short, KV
        # under lower_fill)
        self.calm_windows = 0
        self.short_windows = 0  # consecutive decisions with short_share or more short of a decode replica

    @property
    def k(self) -> int:
        return len(self.decode_ids)

    def observe(self, request_id: str, whole_misses_tbt: bool, decode_short: bool) -> None:
        w = self.window
        if request_id in w.seen:
            return
        w.seen.add(request_id)
        w.priced += 1
        w.whole_misses_tbt += whole_misses_tbt
        w.decode_short += decode_short

    def decode_fill(self, views: Mapping[str, ReplicaView]) -> float:
        """The decode replicas' KV in use and booked, over their capacity."""
        if not self.decode_ids:
            return 0.0
        cap = self.kv_capacity_tokens
        used = sum(views[rid].kv_usage * cap + views[rid].pending_decode_tokens for rid in self.decode_ids)
        return used / (cap * self.k)

    def step(self, eligible: list[str], views: Mapping[str, ReplicaView]) -> int:
        """k's move (-1, 0, +1) on this window's evidence."""
        o, w, k = self.options, self.window, self.k
        whole_share = w.whole_misses_tbt / w.priced
        short = w.decode_short / w.priced
        k_max = max(1, int(len(eligible) * o.max_decode_share))
        if k == 0:
            return 1 if whole_share >= o.enter_share else 0
        self.quiet_windows = self.quiet_windows + 1 if whole_share < o.leave_share else 0
        if self.quiet_windows >= o.leave_windows:
            self.quiet_windows = 0
            return -1
        fill = self.decode_fill(views)
        self.short_windows = self.short_windows + 1 if short >= o.short_share else 0
        if k < k_max and (fill > o.raise_fill or self.short_windows >= o.short_windows):
            self.calm_windows = self.short_windows = 0
            return 1
        calm = k > 1 and w.decode_short == 0 and fill * k / (k - 1) < o.lower_fill
        self.calm_windows = self.calm_windows + 1 if calm else 0
        if self.calm_windows >= o.leave_windows:
            self.calm_windows = 0
            return -1
        return 0

    def plan(self, configured: Mapping[str, Role], views: Mapping[str, ReplicaView],
             now: float) -> dict[str, Role] | None:
        """The roles from ``now`` on, or None while they stand (the interval has not
        passed, too few requests were priced, or k stays)."""
        if self.decided_at is None:
            self.decided_at = now
        eligible = [rid for rid in views if configured.get(rid, "both") == "both"]
        lost = [rid for rid in self.decode_ids
                if rid not in views or not views[rid].healthy or configured.get(rid, "both") != "both"]
        if lost:
            return self.replace(lost, configured, eligible, views)
        if now - self.decided_at < self.options.interval_s or self.window.priced < self.options.min_requests:
            return None
        changed = False
        move = self.step(eligible, views) if len(eligible) >= 2 else -self.k
        self.window = PlanWindow()
        self.decided_at = now
        if move > 0:
            # the replica with the least prefill ahead: its decodes are stretched least
            free = [rid for rid in eligible if rid not in self.decode_ids and views[rid].healthy]
            if free:
                self.decode_ids.append(min(free, key=lambda r: (views[r].pending_prefill_tokens, r)))
                changed = True
        elif move < 0 and self.decode_ids:
            # the one decoding least goes back to taking prefill
            self.decode_ids.remove(min(self.decode_ids, key=lambda r: (views[r].num_running
                                                                       + views[r].pending_decodes, r)))
            changed = True
        if not changed:
            return None
        return self.roles(configured, eligible)

    def replace(self, lost: list[str], configured: Mapping[str, Role], eligible: list[str],
                views: Mapping[str, ReplicaView]) -> dict[str, Role]:
        """The decode replicas ``lost`` leave the plan; each is replaced by the healthy
        eligible replica with the least prefill ahead while one is left (k stays; the
        window and the time of the last decision stand)."""
        self.decode_ids = [rid for rid in self.decode_ids if rid not in lost]
        for _ in lost:
            free = [rid for rid in eligible if rid not in self.decode_ids and views[rid].healthy]
            if not free:
                break
            self.decode_ids.append(min(free, key=lambda r: (views[r].pending_prefill_tokens, r)))
        return self.roles(configured, eligible)

    def roles(self, configured: Mapping[str, Role], eligible: list[str]) -> dict[str, Role]:
        roles = dict(configured)
        others: Role = "prefill" if self.decode_ids and self.options.others_prefill_only else "both"
        for rid in eligible:
            roles[rid] = "decode" if rid in self.decode_ids else others
        return roles


class ElasticConductor(Conductor):
    name = "elastic"
    options: ElasticOptions

    def __init__(self, options: Any, ctx: PairContext) -> None:
        super().__init__(options, ctx)
        self.plan = RolePlan(options, ctx.cost.kv_capacity_tokens)

    def choose(self, req: RoutingRequest, decision: Decision, views: Mapping[str, ReplicaView],
               roles: Mapping[str, Role], excluded: AbstractSet[str], now: float) -> PairChoice | None:
        cands = self.candidates(req, decision, views, roles, excluded, now)
        p = decision.replica_id
        _, tbt_slo = self.pricing.targets(req)
        from_p = [c for c in cands if c.prefill == p]
        whole = next((c for c in from_p if c.decode is None), None)
        if whole is None and from_p:  # p takes no decode now: price it as if it did
            whole = self.pricing.aggregated(req, views[from_p[0].prefill], from_p[0].matched_tokens, now)
        short = not any(c.decode is not None and c.tbt_s <= tbt_slo for c in from_p)
        self.plan.observe(req.request_id, whole is not None and whole.tbt_s > tbt_slo, short)
        return self.best(req, cands)

    def plan_roles(self, configured: Mapping[str, Role], views: Mapping[str, ReplicaView],
                   now: float) -> Mapping[str, Role] | None:
        return self.plan.plan(configured, views, now)
