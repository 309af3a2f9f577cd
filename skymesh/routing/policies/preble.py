"""Preble's rule: a prompt more than half cached on some replica goes there; otherwise
the replica with the lowest load cost = its pending prefill work + this request's prefill
of the part it does not have cached there."""

from __future__ import annotations

from collections.abc import Mapping

from skymesh.routing.base import Decision, ReplicaView, RoutingRequest
from skymesh.routing.policies.common import available, decide, least_loaded
from skymesh.routing.policies.min_ttft import EstimatingPolicy


class PreblePolicy(EstimatingPolicy):
    name = "preble"

    def choose(self, req: RoutingRequest, replicas: Mapping[str, ReplicaView], now: float) -> Decision:
        views = available(replicas)
        if not views:
            return Decision(None, "none available")
        threshold = float(self.ctx.options.get("hit_threshold", 0.5))
        matched, owners = self.best_prefix(req, views)
        if owners and req.prompt_tokens and matched / req.prompt_tokens > threshold:
            v = least_loaded(owners)
            assert v is not None
            self.remember(req, v, matched)
            return decide(v, "cache_hit", matched)
        per = self.trie.match_per_target(req.chunk_hashes, (v.replica_id for v in views))

        def cost(v: ReplicaView) -> tuple[float, int, str]:
            uncached = req.prompt_tokens - self.hit_tokens(req, per[v.replica_id])
            return (self.estimator.estimate(v.pending_prefill_tokens, uncached), v.in_flight, v.replica_id)

        v = min(views, key=cost)
        m = self.hit_tokens(req, per[v.replica_id])
        self.remember(req, v, m)
        return decide(v, "load_cost", m, cost(v)[0])
