"""Preble's rule: a prompt more than half cached on some replica goes there; otherwise
the replica with the lowest load cost = its pending prefill work + this request's prefill
of the part it does not have cached there."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field

from skymesh.routing.base import Decision, PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.options import PolicyOptions
from skymesh.routing.policies.common import available, decide, least_loaded
from skymesh.routing.policies.min_ttft import EstimatingPolicy


class PrebleOptions(PolicyOptions):
    """``policy.options`` of ``preble``."""

    # a prompt cached on some replica beyond this share goes there (Preble: half)
    hit_threshold: float = Field(0.5, ge=0, le=1)


class PreblePolicy(EstimatingPolicy):
    name = "preble"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.hit_threshold = PrebleOptions.parse(ctx.options).hit_threshold

    def choose(self, req: RoutingRequest, replicas: Mapping[str, ReplicaView], now: float) -> Decision:
        views = available(replicas)
        if not views:
            return Decision(None, "none available")
        threshold = self.hit_threshold
        matched, owners = self.best_prefix(req, views)
        if owners and req.prompt_tokens and matched / req.prompt_tokens > threshold:
            v = least_loaded(owners)
            assert v is not None
            self.remember(req, v, matched)
            return decide(v, "cache_hit", matched)
        # load cost = pending prefill work + this request's uncached prefill: the same
        # quantity the TTFT model is linear in, so the cheapest is the minimum-TTFT replica
        v, hit = self.least_prefill_work(req, views)
        self.remember(req, v, hit)
        est = self.estimator.estimate(v.pending_prefill_tokens, req.prompt_tokens - hit)
        return decide(v, "load_cost", hit, est)
