"""SGLang router's cache-aware rule.

If the load is imbalanced — (max − min) in-flight above ``balance_abs_threshold`` AND max
above ``balance_rel_threshold`` × min — route to the least loaded replica. Otherwise, if
the best prefix match covers more than ``cache_threshold`` of the prompt, route to the
replica holding it; else to the replica whose cache tree is smallest (most room), which
is how SGLang spreads new prefixes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import Field

from skymesh.routing.base import Decision, PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.options import PolicyOptions
from skymesh.routing.policies.common import CacheTrackingPolicy, available, decide, least_loaded


class CacheAwareOptions(PolicyOptions):
    """``policy.options`` of ``cache_aware`` (SGLang router's defaults)."""

    cache_threshold: float = Field(0.5, ge=0, le=1)  # matched share of the prompt
    balance_abs_threshold: int = Field(32, ge=0)  # in-flight gap (max - min)
    balance_rel_threshold: float = Field(1.5, ge=0)  # max over min in flight


class CacheAwarePolicy(CacheTrackingPolicy):
    name = "cache_aware"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        o = CacheAwareOptions.parse(ctx.options)
        self.cache_threshold = o.cache_threshold
        self.balance_abs = o.balance_abs_threshold
        self.balance_rel = o.balance_rel_threshold
        self.tree_tokens: dict[str, int] = {}  # tokens each replica was sent (its tree size)

    def set_replicas(self, replica_ids: Sequence[str]) -> None:
        super().set_replicas(replica_ids)
        self.tree_tokens = {r: self.tree_tokens.get(r, 0) for r in replica_ids}

    def on_dispatch(self, req: RoutingRequest, replica_id: str, now: float) -> None:
        matched, _ = self.cache.longest_match(req.chunk_hashes, (replica_id,))
        new_tokens = max(0, req.prompt_tokens - self.hit_tokens(req, matched))
        self.tree_tokens[replica_id] = self.tree_tokens.get(replica_id, 0) + new_tokens
        super().on_dispatch(req, replica_id, now)

    def choose(self, req: RoutingRequest, replicas: Mapping[str, ReplicaView], now: float) -> Decision:
        views = available(replicas)
        if not views:
            return Decision(None, "none available")
        lo = hi = views[0].in_flight
        for v in replicas.values():
            if v.healthy:
                load = v.in_flight
                if load > hi:
                    hi = load
                elif load < lo:
                    lo = load
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            v = min(views, key=lambda x: (x.in_flight, x.replica_id))
            return decide(v, "imbalance")
        matched, owners = self.best_prefix(req, views)
        if owners and req.prompt_tokens and matched / req.prompt_tokens > self.cache_threshold:
            v = least_loaded(owners)
            assert v is not None
            return decide(v, "cache_hit", matched)
        # the smallest tree (fewest tokens sent), then fewest in flight: int comparisons,
        # tie tuples only on ties (this loop runs over every replica)
        tree = self.tree_tokens
        best = views[0]
        best_size = tree.get(best.replica_id, 0)
        for v in views:
            size = tree.get(v.replica_id, 0)
            if size < best_size or (
                size == best_size and (v.in_flight, v.replica_id) < (best.in_flight, best.replica_id)
            ):
                best, best_size = v, size
        return decide(best, "smallest_tree")
