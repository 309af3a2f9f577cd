"""Mooncake's rule: the available replica with the smallest estimated TTFT (queue time
from pending prefill tokens + prefill of the uncached part), with the estimator refitted
from observed TTFTs."""

from __future__ import annotations

from collections.abc import Mapping

from skymesh.routing.base import Decision, PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.options import PolicyOptions
from skymesh.routing.policies.common import CacheTrackingPolicy, available, decide


class EstimatingPolicy(CacheTrackingPolicy):
    """A cache-tracking policy that estimates TTFTs and learns from the observed ones."""

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        # the region model's cost model: refitted here, read by offload and the disciplines
        self.estimator = self.model.estimator
        # request id -> (pending tokens ahead, uncached tokens) at the moment it was placed
        self._placed: dict[str, tuple[int, int]] = {}

    def remember(self, req: RoutingRequest, view: ReplicaView, matched: int) -> None:
        self._placed[req.request_id] = (view.pending_prefill_tokens, req.prompt_tokens - matched)
        if len(self._placed) > 100_000:  # requests that never completed: drop the oldest
            self._placed.pop(next(iter(self._placed)))

    def least_prefill_work(
        self, req: RoutingRequest, views: list[ReplicaView]
    ) -> tuple[ReplicaView, int]:
        """The view with the smallest estimated TTFT, and its cached prefix tokens.

        Every replica shares one linear model (fixed + slope x tokens, slope > 0), so the
        smallest estimate is the smallest prefill work ahead + uncached: compared as
        integers, without evaluating the model per replica (this runs over all replicas).
        Ties: fewer in flight, then replica id.
        """
        per = self.cache.match_per_target(req.chunk_hashes, [v.replica_id for v in views])
        prompt = req.prompt_tokens
        chunk = self.ctx.chunk_tokens
        best = views[0]
        best_work: float = float("inf")
        best_hit = 0
        # integer comparisons only in the common case: this loop runs over every replica
        for v in views:
            hit = per[v.replica_id] * chunk
            if hit > prompt:
                hit = prompt
            work = v.pending_prefill_tokens - hit  # + prompt, the same for all
            if work < best_work or (
                work == best_work and (v.in_flight, v.replica_id) < (best.in_flight, best.replica_id)
            ):
                best, best_work, best_hit = v, work, hit
        return best, best_hit

    def on_first_token(self, req: RoutingRequest, replica_id: str, ttft_s: float, now: float) -> None:
        placed = self._placed.pop(req.request_id, None)
        if placed is not None:
            self.estimator.observe(placed[0], placed[1], ttft_s)

    def on_complete(self, req: RoutingRequest, replica_id: str, ok: bool, now: float) -> None:
        self._placed.pop(req.request_id, None)

    def stats(self) -> dict[str, object]:
        return {
            **super().stats(),
            "ttft_model": {
                "s_per_token": self.estimator.s_per_token,
                "fixed_s": self.estimator.fixed_s,
                "observations": self.estimator.observations,
            },
        }


class MinTTFTOptions(PolicyOptions):
    """``policy.options`` of ``min_ttft``: no knobs beyond the shared ones."""


class MinTTFTPolicy(EstimatingPolicy):
    name = "min_ttft"

    def choose(self, req: RoutingRequest, replicas: Mapping[str, ReplicaView], now: float) -> Decision:
        views = available(replicas)
        if not views:
            return Decision(None, "none available")
        v, hit = self.least_prefill_work(req, views)
        self.remember(req, v, hit)
        est = self.estimator.estimate(v.pending_prefill_tokens, req.prompt_tokens - hit)
        return decide(v, "min_ttft", hit, est)
