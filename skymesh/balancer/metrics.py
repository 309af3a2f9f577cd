"""The balancer's Prometheus metrics. Per-request work is a dict increment or a histogram
bucket; gauges are computed at scrape time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from skymesh.prom import Counter, Gauge, Histogram, Registry
from skymesh.routing.base import Decision, RoutingRequest

if TYPE_CHECKING:
    from skymesh.balancer.server import Balancer

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
_DECISION_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.01)


class BalancerMetrics:
    def __init__(self, b: Balancer) -> None:
        self.b = b
        r = self.registry = Registry()
        labels = ("region",)
        self.decision_seconds = Histogram(
            "skymesh_routing_decision_seconds", "Routing decision time per placed request.", _DECISION_BUCKETS
        )
        self.estimated_ttft = Histogram(
            "skymesh_estimated_ttft_seconds", "TTFT the policy estimated at placement.", _TTFT_BUCKETS
        )
        self.observed_ttft = Histogram(
            "skymesh_observed_ttft_seconds", "TTFT observed by the balancer (dispatch to first token).", _TTFT_BUCKETS
        )
        self.prefix_hit_estimate = Histogram(
            "skymesh_prefix_hit_estimate_ratio",
            "Share of the prompt the policy expected to hit in the replica cache.",
            (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
        )
        self.dispatches = Counter("skymesh_dispatches_total", "Requests dispatched per replica.", ("replica",))
        self.retries = Counter("skymesh_retries_total", "Attempts retried before the first byte.", ("target_kind",))
        self.rejections = Counter("skymesh_rejections_total", "Requests answered with an error.", ("status",))
        self.offloaded = Counter(
            "skymesh_offloaded_total", "Requests forwarded between regions.", ("direction", "peer")
        )
        self.midstream_failures = Counter(
            "skymesh_midstream_failures_total", "Streams ended by an upstream failure after the first byte.",
            ("target_kind",),
        )
        gauges = [
            Gauge("skymesh_queue_length", "Requests waiting at the balancer.", labels,
                  lambda: [((b.region,), b.core.queue_length)]),
            Gauge("skymesh_in_flight", "Requests dispatched and not finished.", labels,
                  lambda: [((b.region,), b.core.in_flight_count)]),
            Gauge("skymesh_replicas_available", "Replicas available (selective pushing).", labels,
                  lambda: [((b.region,), b.core.available_count())]),
            Gauge("skymesh_replica_in_flight", "In-flight requests per replica.", ("replica",),
                  lambda: [((rid,), v.in_flight) for rid, v in b.core.replicas.items()]),
            Gauge("skymesh_replica_pending_prefill_tokens", "Prefill tokens dispatched, no first token yet.",
                  ("replica",), lambda: [((rid,), v.pending_prefill_tokens) for rid, v in b.core.replicas.items()]),
            Gauge("skymesh_peer_staleness_seconds", "Age of the last heartbeat from each peer.", ("peer",),
                  self._staleness),
            Gauge("skymesh_peer_available", "1 when a peer region can take offloaded requests.", ("peer",),
                  self._peer_available),
            Gauge("skymesh_prefix_hit_ratio", "Prefix-cache hit ratio of this region's replicas.", labels,
                  lambda: [((b.region,), b.prefix_hit_ratio())]),
        ]
        for m in (self.decision_seconds, self.estimated_ttft, self.observed_ttft, self.prefix_hit_estimate,
                  self.dispatches, self.retries, self.rejections, self.offloaded, self.midstream_failures,
                  *gauges):
            r.add(m)

    def _now(self) -> float:
        import asyncio

        return asyncio.get_running_loop().time()

    def _staleness(self) -> Iterable[tuple[tuple[str, ...], float]]:
        now = self._now()
        for region in self.b.offload.peers:
            s = self.b.offload.staleness_s(region, now)
            yield (region,), (s if s != float("inf") else -1.0)

    def _peer_available(self) -> Iterable[tuple[tuple[str, ...], float]]:
        now = self._now()
        for region in self.b.offload.peers:
            yield (region,), 1.0 if self.b.offload.peer_available(region, now) else 0.0

    def observe_decision(self, req: RoutingRequest, d: Decision) -> None:
        self.dispatches.inc(d.replica_id or "")
        if d.estimated_ttft_s is not None:
            self.estimated_ttft.observe(d.estimated_ttft_s)
        if req.prompt_tokens:
            self.prefix_hit_estimate.observe(min(1.0, d.matched_tokens / req.prompt_tokens))

    def render(self) -> str:
        return self.registry.render()
