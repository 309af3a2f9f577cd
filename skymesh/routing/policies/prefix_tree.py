"""SkyWalker's local policy: the longest cached prefix among available replicas; with no
match, the least loaded available replica."""

from __future__ import annotations

from collections.abc import Mapping

from skymesh.routing.base import Decision, ReplicaView, RoutingRequest
from skymesh.routing.options import PolicyOptions
from skymesh.routing.policies.common import CacheTrackingPolicy, available, decide, least_loaded


class PrefixTreeOptions(PolicyOptions):
    """``policy.options`` of ``prefix_tree``: no knobs beyond the shared ones."""


class PrefixTreePolicy(CacheTrackingPolicy):
    name = "prefix_tree"

    def choose(self, req: RoutingRequest, replicas: Mapping[str, ReplicaView], now: float) -> Decision:
        views = available(replicas)
        if not views:
            return Decision(None, "none available")
        matched, owners = self.best_prefix(req, views)
        if matched and owners:
            v = least_loaded(owners)
            assert v is not None
            return decide(v, "prefix", matched)
        v = least_loaded(views)
        assert v is not None
        return decide(v, "least_load")
