"""DualMap: dual-hash candidates with SLO-aware choice and hotspot-aware migration.

- Candidates: the prompt's ring key (its first ``key_length`` chunks, grown for hot
  prefixes by the hotness tree) hashed twice onto the dual hash ring → (c1, c2).
- SLO-aware choice: keep the cache-affine candidate (more cached prefix tokens) while its
  estimated TTFT meets the SLO; otherwise take the candidate with the lower estimate.
  Equal hits → the less loaded one (power of two choices).
- SLO escape: when even the better candidate's estimate breaks the SLO, the available
  replica with the least prefill work ahead (cache hits counted) is taken instead, if its
  estimate is lower: two fixed candidates cannot absorb a burst on one conversation pair.
- Selective pushing: only available candidates can be returned. When neither is
  available the request is *held* at the balancer for its preferred candidate while its
  wait so far is within ``max_hold_fraction`` of the SLO's slack (SLO − estimated TTFT);
  after that (at once with the default 0) it spills to the best available replica.
- Waiting for a faster busy candidate (``wait_for_faster_candidate``): selective pushing
  makes a loaded candidate unavailable, and taking whatever is free instead throws its
  cache away. When a busy candidate's estimated TTFT (its prefill work ahead, plus what
  the balancer already holds for it, plus this request's uncached prefill there) beats
  the best free choice's by ``wait_margin_s``, the request is held for that candidate
  instead; the comparison is made again at every dispatch round, so it goes elsewhere
  as soon as that is faster.
- Hotspot-aware rebalancing: a held request migrates to its other candidate when the
  benefit B = TTFT_i − TTFT_j > 0 and TTFT_j < SLO, where TTFT includes the prefill work
  already held at the balancer for that replica.

Why the options default as they do (the runs that decided it): docs/benchmarks.md,
"DualMap's option defaults, as measured".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from skymesh.routing.base import Decision, Migration, PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.hashing import key_hash
from skymesh.routing.hotness import HotnessTree
from skymesh.routing.options import PolicyOptions
from skymesh.routing.policies.common import available, decide, least_loaded
from skymesh.routing.policies.min_ttft import EstimatingPolicy
from skymesh.routing.ring import DualHashRing


class DualMapOptions(PolicyOptions):
    """``policy.options`` of ``dualmap``."""

    virtual_nodes: int = Field(160, ge=1)  # points per replica on the dual hash ring
    # ring key = the prompt's first ``base_key_chunks`` chunks, grown for hot prefixes
    base_key_chunks: int = Field(1, ge=1)
    hotness_window: int = Field(512, ge=1)  # requests the hotness tree counts over
    hotness_window_s: float | None = Field(None, gt=0)  # or a time window; None: count only
    # when neither candidate is available, hold the request for its preferred one while its
    # wait is within this share of the SLO's slack; 0: spill at once (holding measured
    # worse: docs/benchmarks.md, "DualMap's option defaults, as measured")
    max_hold_fraction: float = Field(0.0, ge=0)
    # the cache-affine candidate is kept while its estimate is within this share of the SLO
    affinity_slo_fraction: float = Field(1.0, ge=0)
    # when even the better candidate's estimate breaks the SLO, take the available replica
    # with the least prefill work ahead instead (one O(n) scan, only for requests that would
    # miss anyway): two fixed candidates cannot absorb a burst on one pair
    escape_over_slo: bool = True
    # hold for a busy candidate whose estimate beats the best free choice by
    # ``wait_margin_s``, rather than throw its cache away on a free replica
    wait_for_faster_candidate: bool = True
    wait_margin_s: float = Field(0.0, ge=0)


class DualMapPolicy(EstimatingPolicy):
    name = "dualmap"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        o = DualMapOptions.parse(ctx.options)
        self.ring = DualHashRing(virtual_nodes=o.virtual_nodes)
        self.hotness = HotnessTree(
            base_chunks=o.base_key_chunks, window=o.hotness_window, window_s=o.hotness_window_s
        )
        self.max_hold_fraction = o.max_hold_fraction
        self.affinity_slo_fraction = o.affinity_slo_fraction
        self.escape_over_slo = o.escape_over_slo
        self.wait_for_faster = o.wait_for_faster_candidate
        self.wait_margin_s = o.wait_margin_s
        # request id -> (the candidate it is held for, its uncached prefill tokens there):
        # the work that will reach that replica before a request held now
        self._held: dict[str, tuple[str, int]] = {}
        self._backlog: dict[str, int] = {}  # replica -> held tokens for it
        self.migrations_total = 0

    def set_replicas(self, replica_ids: Sequence[str]) -> None:
        super().set_replicas(replica_ids)
        self.ring.set_members(replica_ids)
        members = set(replica_ids)
        for request_id in [k for k, (v, _) in self._held.items() if v not in members]:
            self._unhold(request_id)

    def held_for(self, request_id: str) -> str | None:
        """The candidate ``request_id`` is held for at the balancer, if any."""
        held = self._held.get(request_id)
        return None if held is None else held[0]

    def candidates(self, req: RoutingRequest) -> tuple[str, str]:
        n = len(self.ring)
        length = self.hotness.key_length(req.chunk_hashes, n)
        return self.ring.candidates(key_hash(req.chunk_hashes, length))

    def _slo(self, req: RoutingRequest) -> float:
        return req.slo_ttft_s if req.slo_ttft_s is not None else self.ctx.ttft_slo_s

    def choose(self, req: RoutingRequest, replicas: Mapping[str, ReplicaView], now: float) -> Decision:
        if len(self.ring) == 0:
            return Decision(None, "no replicas")
        self.hotness.expire(now, len(self.ring))
        c1, c2 = self.candidates(req)
        per = self.cache.match_per_target(req.chunk_hashes, (c1, c2))
        pinned = self.held_for(req.request_id)
        cands = []
        for rid in dict.fromkeys((c1, c2)):
            v = replicas.get(rid)
            if v is None:
                continue
            hit = self.hit_tokens(req, per.get(rid, 0))
            est = self.estimator.estimate(v.pending_prefill_tokens, req.prompt_tokens - hit)
            cands.append((v, hit, est))
        slo = self._slo(req)
        ok = [c for c in cands if c[0].available and c[0].healthy]
        if pinned is not None:
            for c in ok:
                if c[0].replica_id == pinned:
                    return self._place(req, c, "migrated" if pinned != c1 else "affinity")
        if ok:
            if len(cands) == 2 and cands[0][1] != cands[1][1]:
                affine = max(cands, key=lambda c: c[1])
                if affine in ok and affine[2] <= self.affinity_slo_fraction * slo:
                    return self._place(req, affine, "affinity")
            # equal hits, or the affine one would break the SLO / is busy: lower estimate
            best = min(ok, key=lambda c: (c[2], c[0].in_flight, c[0].replica_id))
            reason = "slo" if len(ok) == 2 else "available_candidate"
            if self.escape_over_slo and best[2] > slo:
                views = available(replicas)
                v, hit = self.least_prefill_work(req, views)
                est = self.estimator.estimate(v.pending_prefill_tokens, req.prompt_tokens - hit)
                if est < best[2]:
                    best, reason = (v, hit, est), "escape"
            if self._wait_instead(req, cands, ok, best[2]):
                return Decision(None, "wait_for_candidate")
            return self._place(req, best, reason)
        # neither candidate can take it now
        waited = now - req.arrival
        best_est = min((c[2] for c in cands), default=0.0)
        # hold while the wait has used at most a fraction of the SLO's slack over the
        # candidate's own estimate; a request that could not meet the SLO anyway spills
        if self.max_hold_fraction > 0 and waited <= self.max_hold_fraction * (slo - best_est):
            if pinned is None and cands:
                v, hit, _ = max(cands, key=lambda c: (c[1], -c[2]))
                self._hold(req.request_id, v.replica_id, req.prompt_tokens - hit)
            return Decision(None, "hold")
        views = available(replicas)
        if not views:
            return Decision(None, "none available")
        # spilling: among the holders of the longest cached prefix (all hit the same
        # tokens), or among everyone (no hits), the lowest estimate = the least pending
        chunks, owner_ids = self.cache.longest_match(req.chunk_hashes, {v.replica_id for v in views})
        if chunks:
            pick = least_loaded(replicas[rid] for rid in owner_ids)
        else:
            pick = least_loaded(views)
        assert pick is not None
        v = pick
        hit = self.hit_tokens(req, chunks)
        est = self.estimator.estimate(v.pending_prefill_tokens, req.prompt_tokens - hit)
        if self._wait_instead(req, cands, ok, est):
            return Decision(None, "wait_for_candidate")
        return self._place(req, (v, hit, est), "spill")

    def _wait_instead(self, req: RoutingRequest, cands: list[tuple[ReplicaView, int, float]],
                      ok: list[tuple[ReplicaView, int, float]], free_est: float) -> bool:
        """Hold ``req`` for its busy candidate when that is estimated faster than the best
        free choice (``free_est``): work held for the candidate counts as ahead of it."""
        if not self.wait_for_faster:
            return False
        busy = [c for c in cands if c not in ok and c[0].healthy]
        if not busy:
            return False
        own = self._held.get(req.request_id)
        best_rid, best_est, best_uncached = "", float("inf"), 0
        for v, hit, _ in busy:
            rid = v.replica_id
            held_ahead = self._backlog.get(rid, 0) - (own[1] if own is not None and own[0] == rid else 0)
            uncached = req.prompt_tokens - hit
            est = self.estimator.estimate(v.pending_prefill_tokens + held_ahead, uncached)
            if est < best_est:
                best_rid, best_est, best_uncached = rid, est, uncached
        if best_est + self.wait_margin_s >= free_est:
            return False
        self._hold(req.request_id, best_rid, best_uncached)
        return True

    def _hold(self, request_id: str, replica_id: str, tokens: int) -> None:
        self._unhold(request_id)
        self._held[request_id] = (replica_id, tokens)
        self._backlog[replica_id] = self._backlog.get(replica_id, 0) + tokens

    def _unhold(self, request_id: str) -> None:
        work = self._held.pop(request_id, None)
        if work is not None:
            rid, tokens = work
            left = self._backlog.get(rid, 0) - tokens
            if left > 0:
                self._backlog[rid] = left
            else:
                self._backlog.pop(rid, None)

    def _place(self, req: RoutingRequest, cand: tuple[ReplicaView, int, float], reason: str) -> Decision:
        v, hit, est = cand
        self._unhold(req.request_id)
        self.remember(req, v, hit)
        return decide(v, reason, hit, est)

    def on_dispatch(self, req: RoutingRequest, replica_id: str, now: float) -> None:
        self.hotness.observe(req.chunk_hashes, len(self.ring), now)
        super().on_dispatch(req, replica_id, now)

    def on_complete(self, req: RoutingRequest, replica_id: str, ok: bool, now: float) -> None:
        super().on_complete(req, replica_id, ok, now)
        self._unhold(req.request_id)

    def rebalance(
        self, queued: Sequence[RoutingRequest], replicas: Mapping[str, ReplicaView], now: float
    ) -> list[Migration]:
        if not self._held or len(self.ring) < 2:
            return []
        live = {r.request_id for r in queued}
        for request_id in [k for k in self._held if k not in live]:
            self._unhold(request_id)
        # prefill work already held at the balancer for each replica, in queue order
        backlog: dict[str, int] = {}
        moves: list[Migration] = []
        for req in queued:
            target = self.held_for(req.request_id)
            if target is None:
                continue
            c1, c2 = self.candidates(req)
            other = c2 if target == c1 else c1
            vi, vj = replicas.get(target), replicas.get(other)
            if vj is None or not vj.healthy or other == target:
                backlog[target] = backlog.get(target, 0) + req.prompt_tokens
                continue
            per = self.cache.match_per_target(req.chunk_hashes, (target, other))
            hit_i = self.hit_tokens(req, per.get(target, 0))
            hit_j = self.hit_tokens(req, per.get(other, 0))
            ahead_i = (vi.pending_prefill_tokens if vi else 0) + backlog.get(target, 0)
            ahead_j = vj.pending_prefill_tokens + backlog.get(other, 0)
            ttft_i = self.estimator.estimate(ahead_i, req.prompt_tokens - hit_i)
            ttft_j = self.estimator.estimate(ahead_j, req.prompt_tokens - hit_j)
            benefit = ttft_i - ttft_j
            waited = now - req.arrival
            if benefit > 0 and waited + ttft_j < self._slo(req):
                self._hold(req.request_id, other, req.prompt_tokens - hit_j)
                backlog[other] = backlog.get(other, 0) + req.prompt_tokens - hit_j
                moves.append(Migration(req.request_id, target, other, benefit))
            else:
                backlog[target] = backlog.get(target, 0) + req.prompt_tokens - hit_i
        self.migrations_total += len(moves)
        return moves

    def stats(self) -> dict[str, Any]:
        return {
            **super().stats(),
            "held": len(self._held),
            **self.hotness.stats(),
            "migrations": self.migrations_total,
        }
