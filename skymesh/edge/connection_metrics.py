"""The HTTP edge's metrics, in the registry of the server they belong to."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass(frozen=True, slots=True)
class EdgeMetrics:
    connections_open: Gauge
    connections_refused: Counter  # label reason: total | per_source
    rejections: Counter  # label status: what the server answered before the app
    internal_errors: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None, *, rejections: Counter | None = None,
               internal_errors: Counter | None = None) -> EdgeMetrics:
        """The edge's families in ``registry`` (None: the caller registers them); a server
        that counts rejections and internal errors already (the balancer) passes its own
        counters."""
        return cls(
            connections_open=Gauge("skymesh_http_connections_open", "Open HTTP connections.",
                                   registry=registry),
            connections_refused=Counter(
                "skymesh_http_connections_refused_total",
                "HTTP connections refused (503, closed) because a connection cap was reached.",
                ("reason",), registry=registry),
            rejections=rejections or Counter(
                "skymesh_rejections_total", "Requests answered with an error.", ("status",), registry=registry),
            internal_errors=internal_errors or Counter(
                "skymesh_internal_errors_total", "Requests answered 500 because a handler raised unexpectedly.",
                registry=registry),
        )
