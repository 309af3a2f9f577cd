"""Mooncake's rule: the available replica with the smallest estimated TTFT (queue time
from pending prefill tokens + prefill of the uncached part), with the estimator refitted
from observed TTFTs."""

from __future__ import annotations

from collections.abc import Mapping

from skymesh.routing.base import Decision, PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.policies.common import CacheTrackingPolicy, available, decide
from skymesh.routing.ttft import TTFTEstimator


class EstimatingPolicy(CacheTrackingPolicy):
    """A cache-tracking policy that estimates TTFTs and learns from the observed ones."""

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.estimator = TTFTEstimator(ctx.prefill_s_per_token, ctx.prefill_fixed_s)
        # request id -> (pending tokens ahead, uncached tokens) at the moment it was placed
        self._placed: dict[str, tuple[int, int]] = {}

    def remember(self, req: RoutingRequest, view: ReplicaView, matched: int) -> None:
        self._placed[req.request_id] = (view.pending_prefill_tokens, req.prompt_tokens - matched)
        if len(self._placed) > 100_000:  # requests that never completed: drop the oldest
            self._placed.pop(next(iter(self._placed)))

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


class MinTTFTPolicy(EstimatingPolicy):
    name = "min_ttft"

    def choose(self, req: RoutingRequest, replicas: Mapping[str, ReplicaView], now: float) -> Decision:
        views = available(replicas)
        if not views:
            return Decision(None, "none available")
        per = self.trie.match_per_target(req.chunk_hashes, (v.replica_id for v in views))
        best = None
        for v in views:
            matched = self.hit_tokens(req, per[v.replica_id])
            est = self.estimator.estimate(v.pending_prefill_tokens, req.prompt_tokens - matched)
            key = (est, v.in_flight, v.replica_id)
            if best is None or key < best[0]:
                best = (key, v, matched, est)
        assert best is not None
        _, v, matched, est = best
        self.remember(req, v, matched)
        return decide(v, "min_ttft", matched, est)


