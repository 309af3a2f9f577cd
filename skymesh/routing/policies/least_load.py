"""Least load: the available replica with the fewest pending prefill tokens, then the
fewest in-flight requests."""

from __future__ import annotations

from collections.abc import Mapping

from skymesh.routing.base import Decision, ReplicaView, RoutingRequest
from skymesh.routing.options import PolicyOptions
from skymesh.routing.policies.common import BasePolicy, decide, least_loaded


class LeastLoadOptions(PolicyOptions):
    """``policy.options`` of ``least_load``: no knobs beyond the shared ones."""


class LeastLoadPolicy(BasePolicy):
    name = "least_load"

    def choose(self, req: RoutingRequest, replicas: Mapping[str, ReplicaView], now: float) -> Decision:
        v = least_loaded(replicas.values(), only_available=True)
        return Decision(None, "none available") if v is None else decide(v, "least_load")
