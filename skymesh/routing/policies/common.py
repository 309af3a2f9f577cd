"""Pieces every policy shares: availability filters, load order, a cache tracker."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from skymesh.routing.base import Decision, Migration, PolicyContext, ReplicaView, RoutingRequest


def available(replicas: Mapping[str, ReplicaView]) -> list[ReplicaView]:
    return [v for v in replicas.values() if v.available and v.healthy]


def load_key(v: ReplicaView) -> tuple[int, int, str]:
    return (v.pending_prefill_tokens, v.in_flight, v.replica_id)


def least_loaded(views: Iterable[ReplicaView], only_available: bool = False) -> ReplicaView | None:
    """The view with the smallest ``load_key``; with ``only_available``, among the available
    and healthy ones. An explicit loop: comparing the pending-token ints first and building
    tie-break tuples only on ties is several times cheaper than ``min(key=...)`` over
    128 replicas, and this runs on every decision."""
    best: ReplicaView | None = None
    best_pending = 0
    for v in views:
        if only_available and not (v.available and v.healthy):
            continue
        pending = v.pending_prefill_tokens
        if (
            best is None
            or pending < best_pending
            or (pending == best_pending and (v.in_flight, v.replica_id) < (best.in_flight, best.replica_id))
        ):
            best, best_pending = v, pending
    return best


class BasePolicy:
    """No-op lifecycle hooks; policies override what they use."""

    name = "base"

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.replica_ids: list[str] = []

    def set_replicas(self, replica_ids: Sequence[str]) -> None:
        self.replica_ids = list(replica_ids)

    def on_dispatch(self, req: RoutingRequest, replica_id: str, now: float) -> None:
        return None

    def on_first_token(self, req: RoutingRequest, replica_id: str, ttft_s: float, now: float) -> None:
        return None

    def on_complete(self, req: RoutingRequest, replica_id: str, ok: bool, now: float) -> None:
        return None

    def rebalance(
        self, queued: Sequence[RoutingRequest], replicas: Mapping[str, ReplicaView], now: float
    ) -> list[Migration]:
        return []

    def stats(self) -> dict[str, Any]:
        return {}


class CacheTrackingPolicy(BasePolicy):
    """A policy that reads each replica's cache through the region model's
    :class:`~skymesh.routing.cache_view.CacheView` (the replica's KV events when they flow,
    the routing history otherwise). Built on a region's model, the region records each
    dispatch in that history (after the policy's ``on_dispatch``); built alone, on a model
    of its own, the policy records them itself."""

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.records_dispatches = ctx.model is None
        self.model = ctx.model if ctx.model is not None else ctx.standalone_model()
        self.cache = self.model.cache

    def set_replicas(self, replica_ids: Sequence[str]) -> None:
        gone = set(self.replica_ids) - set(replica_ids)
        super().set_replicas(replica_ids)
        for rid in gone:
            self.cache.remove_target(rid)

    def on_dispatch(self, req: RoutingRequest, replica_id: str, now: float) -> None:
        if self.records_dispatches:
            self.model.record_dispatch(req, replica_id, now)

    def hit_tokens(self, req: RoutingRequest, chunks: int) -> int:
        return min(req.prompt_tokens, chunks * self.ctx.chunk_tokens)

    def best_prefix(self, req: RoutingRequest, views: list[ReplicaView]) -> tuple[int, list[ReplicaView]]:
        """Matched tokens of the longest cached prefix among ``views``, and its holders."""
        chunks, owners = self.cache.longest_match(req.chunk_hashes, (v.replica_id for v in views))
        return self.hit_tokens(req, chunks), [v for v in views if v.replica_id in owners]

    def stats(self) -> dict[str, Any]:
        return {"trie": self.cache.stats()}


def decide(view: ReplicaView, reason: str, matched: int = 0, est: float | None = None) -> Decision:
    return Decision(replica_id=view.replica_id, reason=reason, matched_tokens=matched, estimated_ttft_s=est)
