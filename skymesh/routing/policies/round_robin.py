"""Round robin over available replicas (the classic baseline)."""

from __future__ import annotations

from collections.abc import Mapping

from skymesh.routing.base import Decision, PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.options import PolicyOptions
from skymesh.routing.policies.common import BasePolicy, decide


class RoundRobinOptions(PolicyOptions):
    """``policy.options`` of ``round_robin``: no knobs beyond the shared ones."""


class RoundRobinPolicy(BasePolicy):
    name = "round_robin"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._next = 0

    def choose(self, req: RoutingRequest, replicas: Mapping[str, ReplicaView], now: float) -> Decision:
        ids = self.replica_ids
        for step in range(len(ids)):
            rid = ids[(self._next + step) % len(ids)]
            v = replicas.get(rid)
            if v is not None and v.available and v.healthy:
                self._next = (self._next + step + 1) % len(ids)
                return decide(v, "round_robin")
        return Decision(None, "none available")
