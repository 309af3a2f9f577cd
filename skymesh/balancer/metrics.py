"""The balancer's Prometheus metrics, in prometheus_client with one registry per balancer
(several balancers share a process in tests and the mesh benchmarks).

Per-request work is a counter increment or a histogram observation. Load gauges (queue,
in-flight, per-replica and per-peer state) are not kept up to date on every change: a
scrape-time collector reads them through one narrow callable, :class:`BalancerSnapshot`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from skymesh.balancer.autoscaling_signal import pending_prefill_s_per_replica
from skymesh.edge.connection_metrics import EdgeMetrics
from skymesh.routing.base import Decision, RoutingRequest
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.region import RegionCore

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
_DECISION_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.01)
_PREFIX_HIT_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
# what a client sees, end to end: from a few ms (a cached prompt nearby) to minutes
_E2E_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
# the labels of the client-seen latencies: this balancer's region, the request's SLO class
# ("none" without one) and where its answer came from ("local" replica or a "peer" region)
CLIENT_LATENCY_LABELS = ("region", "slo_class", "served")
NO_SLO_CLASS = "none"


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    replica_id: str
    in_flight: int
    pending_prefill_tokens: int


@dataclass(frozen=True, slots=True)
class PeerHealth:
    region: str
    staleness_s: float  # age of the last heartbeat; inf when none was ever received
    available: bool  # can take offloaded requests


@dataclass(frozen=True, slots=True)
class BalancerSnapshot:
    """The balancer's load, as one scrape sees it."""

    queue_length: int
    in_flight: int
    replicas_available: int
    prefix_hit_ratio: float
    replicas: Sequence[ReplicaLoad]
    peers: Sequence[PeerHealth]
    # request lifecycle transitions since start: (from state, to state) -> count
    transitions: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # supervised background loops restarted after an exception: loop name -> count
    loop_restarts: Mapping[str, int] = field(default_factory=dict)
    ejected_replicas: int = 0
    # peer heartbeat traffic refused (mesh identity), by reason
    rejected_peer_calls: Mapping[str, int] = field(default_factory=dict)
    # the autoscaling signal: predicted seconds of prefill waiting per healthy replica
    pending_prefill_s_per_replica: float = 0.0
    # the sibling channel's counters (SiblingLink.counts; empty in a region of one)
    sibling_link: Mapping[str, int] = field(default_factory=dict)


class PeerRefusals(Protocol):
    """Peer traffic refused by mesh identity (the balancer's PeerMeshPort)."""

    def rejected_peer_calls(self) -> dict[str, int]: ...


class SnapshotSource(Protocol):
    """What a scrape reads off the balancer (skymesh.balancer.server.Balancer)."""

    @property
    def core(self) -> RegionCore: ...

    @property
    def offload(self) -> OffloadRouter: ...

    @property
    def peer_mesh_port(self) -> PeerRefusals: ...

    def prefix_hit_ratio(self) -> float: ...

    def loop_restart_counts(self) -> dict[str, int]: ...

    def sibling_link_counts(self) -> dict[str, int]: ...


def balancer_snapshot(b: SnapshotSource) -> BalancerSnapshot:
    """Reads a :class:`BalancerSnapshot` off a running balancer: the one place the metrics
    know the Balancer's fields (called in the /metrics handler, on the event loop)."""
    now = asyncio.get_running_loop().time()
    return BalancerSnapshot(
        queue_length=b.core.view.queue_length,
        in_flight=b.core.view.in_flight_count,
        replicas_available=b.core.view.available_count(),
        prefix_hit_ratio=b.prefix_hit_ratio(),
        # this balancer's own (a region of several: the members' figures add up)
        replicas=[ReplicaLoad(rid, r.in_flight, b.core.view.own_pending_prefill(rid)) for rid, r in b.core.view.replicas.items()],
        peers=[PeerHealth(region, b.offload.staleness_s(region, now), b.offload.peer_available(region, now))
               for region in b.offload.peers],
        transitions=dict(b.core.transitions),
        loop_restarts=b.loop_restart_counts(),
        ejected_replicas=b.core.view.ejected_count(),
        rejected_peer_calls=b.peer_mesh_port.rejected_peer_calls(),
        pending_prefill_s_per_replica=pending_prefill_s_per_replica(b.core),
        sibling_link=b.sibling_link_counts(),
    )


class _LoadCollector:
    """The load gauges, from one snapshot per scrape."""

    def __init__(self, region: str, snapshot: Callable[[], BalancerSnapshot]) -> None:
        self.region = region
        self.snapshot = snapshot

    def _gauge(self, name: str, help_text: str, label: str,
               values: Iterable[tuple[str, float]]) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, help_text, labels=(label,))
        for label_value, value in values:
            g.add_metric((label_value,), value)
        return g

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        here = self.region
        yield self._gauge("skymesh_queue_length", "Requests waiting at the balancer.", "region",
                          [(here, s.queue_length)])
        yield self._gauge("skymesh_in_flight", "Requests dispatched and not finished.", "region",
                          [(here, s.in_flight)])
        yield self._gauge("skymesh_replicas_available", "Replicas available (selective pushing).", "region",
                          [(here, s.replicas_available)])
        yield self._gauge("skymesh_replica_in_flight", "In-flight requests per replica.", "replica",
                          [(r.replica_id, r.in_flight) for r in s.replicas])
        yield self._gauge("skymesh_replica_pending_prefill_tokens", "Prefill tokens dispatched, no first token yet.",
                          "replica", [(r.replica_id, r.pending_prefill_tokens) for r in s.replicas])
        # -1 for a peer never heard from: the page has always said so, dashboards key on it
        yield self._gauge("skymesh_peer_staleness_seconds", "Age of the last heartbeat from each peer.", "peer",
                          [(p.region, p.staleness_s if p.staleness_s != float("inf") else -1.0) for p in s.peers])
        yield self._gauge("skymesh_peer_available", "1 when a peer region can take offloaded requests.", "peer",
                          [(p.region, 1.0 if p.available else 0.0) for p in s.peers])
        yield self._gauge("skymesh_prefix_hit_ratio", "Prefix-cache hit ratio of this region's replicas.", "region",
                          [(here, s.prefix_hit_ratio)])
        yield self._gauge("skymesh_replicas_ejected", "Replicas ejected by the health tracker.", "region",
                          [(here, s.ejected_replicas)])
        yield self._gauge("skymesh_autoscaling_pending_prefill_seconds_per_replica",
                          "Predicted seconds of prefill work waiting (queued and dispatched without a first "
                          "token) per healthy replica: the autoscaling signal.", "region",
                          [(here, s.pending_prefill_s_per_replica)])
        transitions = CounterMetricFamily(
            "skymesh_request_transitions", "Request lifecycle transitions (new, queued, placed, streaming, "
            "done, failed, rejected, cancelled).", labels=("from_state", "to_state"))
        for (frm, to), n in sorted(s.transitions.items()):
            transitions.add_metric((frm, to), n)
        yield transitions
        refused = CounterMetricFamily(
            "skymesh_rejected_peer_calls", "Peer heartbeats or streams refused by mesh identity.",
            labels=("reason",))
        for reason, n in sorted(s.rejected_peer_calls.items()):
            refused.add_metric((reason,), n)
        yield refused
        sib = s.sibling_link
        messages = CounterMetricFamily(
            "skymesh_sibling_messages", "Sibling channel messages: sent (one per fan-out to every sibling stream) "
            "and applied (received and newer than what was heard).", labels=("direction",))
        dropped = CounterMetricFamily(
            "skymesh_sibling_messages_dropped", "Sibling messages dropped before the core, by reason.",
            labels=("reason",))
        refused_streams = CounterMetricFamily(
            "skymesh_sibling_streams_refused", "Sibling streams refused: the caller's certificate is not this "
            "region's balancer's.")
        looks = CounterMetricFamily(
            "skymesh_sibling_state_looks", "Times the balancer looked at its state for its siblings, and of those "
            "the ones that sent nothing (quiet).", labels=("outcome",))
        if sib:
            messages.add_metric(("sent",), sib.get("sent", 0))
            messages.add_metric(("applied",), sib.get("applied", 0))
            looks.add_metric(("sent",), sib.get("looks", 0) - sib.get("quiet_looks", 0))
            looks.add_metric(("quiet",), sib.get("quiet_looks", 0))
            refused_streams.add_metric((), sib.get("refused_streams", 0))
            for key, n in sorted(sib.items()):
                if key.startswith("dropped_"):
                    dropped.add_metric((key.removeprefix("dropped_"),), n)
        yield messages
        yield dropped
        yield refused_streams
        yield looks
        restarts = CounterMetricFamily(
            "skymesh_loop_restarts", "Background loops restarted after an exception.", labels=("loop",))
        for loop, n in sorted(s.loop_restarts.items()):
            restarts.add_metric((loop,), n)
        yield restarts


class _WithoutCreatedSamples:
    """The families of some prometheus_client metrics, less their ``<name>_created`` samples.

    The balancer's page never had them. prometheus_client's own switch for them
    (``disable_created_metrics``) is process-wide, and would also take them off the vLLM
    stand-in's page, where vLLM has them, whenever both run in one process.
    """

    def __init__(self, metrics: Sequence[Counter | Histogram]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            for family in metric.collect():  # a fresh Metric per collect: ours to edit
                created = family.name + "_created"
                family.samples = [s for s in family.samples if s.name != created]
                yield family


class BalancerMetrics:
    def __init__(self, region: str, snapshot: Callable[[], BalancerSnapshot]) -> None:
        self.region = region
        self.registry = CollectorRegistry()
        # what the client saw, at the balancer it called (a forwarded request is counted
        # once, where its client is): arrival to the first byte of a stream, the time per
        # output token after it, arrival to the end of the answer
        self.client_ttft = Histogram(
            "skymesh_client_ttft_seconds", "Time to first token as the client sees it (arrival at this balancer "
            "to the first byte of a streamed answer).", CLIENT_LATENCY_LABELS, buckets=_TTFT_BUCKETS, registry=None,
        )
        self.client_tpot = Histogram(
            "skymesh_client_tpot_seconds", "Time per output token after the first (streamed answers that report "
            "usage).", CLIENT_LATENCY_LABELS, buckets=_TPOT_BUCKETS, registry=None,
        )
        self.client_e2e = Histogram(
            "skymesh_client_e2e_seconds", "Arrival at this balancer to the end of the answer (served requests).",
            CLIENT_LATENCY_LABELS, buckets=_E2E_BUCKETS, registry=None,
        )
        # registry=None: these reach the page only through _WithoutCreatedSamples
        self.decision_seconds = Histogram(
            "skymesh_routing_decision_seconds", "Routing decision time per placed request.",
            buckets=_DECISION_BUCKETS, registry=None,
        )
        self.estimated_ttft = Histogram(
            "skymesh_estimated_ttft_seconds", "TTFT the policy estimated at placement.",
            buckets=_TTFT_BUCKETS, registry=None,
        )
        self.observed_ttft = Histogram(
            "skymesh_observed_ttft_seconds", "TTFT observed by the balancer (dispatch to first token).",
            buckets=_TTFT_BUCKETS, registry=None,
        )
        self.prefix_hit_estimate = Histogram(
            "skymesh_prefix_hit_estimate_ratio", "Share of the prompt the policy expected to hit in the replica cache.",
            buckets=_PREFIX_HIT_BUCKETS, registry=None,
        )
        self.dispatches = Counter("skymesh_dispatches_total", "Requests dispatched per replica.", ("replica",),
                                  registry=None)
        self.retries = Counter("skymesh_retries_total", "Attempts retried before the first byte.", ("target_kind",),
                               registry=None)
        self.rejections = Counter("skymesh_rejections_total", "Requests answered with an error.", ("status",),
                                  registry=None)
        self.offloaded = Counter("skymesh_offloaded_total", "Requests forwarded between regions.",
                                 ("direction", "peer"), registry=None)
        self.midstream_failures = Counter(
            "skymesh_midstream_failures_total", "Streams ended by an upstream failure after the first byte.",
            ("target_kind",), registry=None,
        )
        # requests answered 502 instead of retried: judged to have made their replica fail
        # (skymesh/routing/harm.py); and prompts refused because they cannot fit the model
        # (skymesh/context_window.py), by the check that refused them
        self.harmful_requests = Counter(
            "skymesh_harmful_requests_total", "Requests answered instead of retried: judged to have made their "
            "replica fail (a stall or a dropped connection under them alone).", registry=None,
        )
        # a request that ended with no complete answer and no error status from this
        # balancer (its client saw its connection close): by why, each with one log line
        # (skymesh/balancer/request_intake.py; a stream cut by its upstream is
        # skymesh_midstream_failures_total)
        self.requests_cut = Counter(
            "skymesh_requests_cut_total", "Requests that ended without an answer from this balancer, by reason "
            "(client_gone_<state>: the client's connection closed while the request was queued, placed or "
            "streaming; stopping: the balancer stopped under it).", ("reason",), registry=None,
        )
        self.context_refusals = Counter(
            "skymesh_context_refusals_total", "Requests refused at the edge because they cannot fit the model's "
            "context (vLLM's own 400), by what proved it (budget, chars, tokens).", ("proved_by",), registry=None,
        )
        # a handler raised something unexpected (skymesh/balancer/middleware.py): always a bug
        self.internal_errors = Counter(
            "skymesh_internal_errors_total", "Requests answered 500 because a handler raised unexpectedly.",
            registry=None,
        )
        # config reloads on SIGHUP (skymesh/balancer/reload_rules.py): ok, or error (the file was
        # invalid or changed settings that need a restart; the running config stayed)
        self.config_reloads = Counter(
            "skymesh_config_reloads_total", "Config reloads (SIGHUP) by result.", ("result",), registry=None,
        )
        for result in ("ok", "error"):
            self.config_reloads.labels(result)
        # replica pages applied, by where they came from: probed (this balancer scraped the
        # replica) or sibling (the member of the fleet that probes it shared its scrape;
        # skymesh/routing/probe_owners.py)
        self.replica_pages = Counter(
            "skymesh_replica_pages_total", "Replica metrics pages applied, by source (probed here, or shared by "
            "the sibling balancer that probes the replica).", ("source",), registry=None,
        )
        for source in ("probed", "sibling"):
            self.replica_pages.labels(source)
        # the policy's expected cached prefix (Decision.matched_tokens) against the replica's
        # own count in the answer's usage (vLLM's --enable-prompt-tokens-details; see
        # skymesh/balancer/usage.py), by what the policy read the cache from
        self.cache_predictions = Counter(
            "skymesh_cache_predictions_total",
            "Served requests whose replica reported its cached prompt tokens, by how the policy's "
            "expectation compared (within one chunk, over, under).",
            ("result", "cache_source"), registry=None,
        )
        # SLO classes (skymesh/balancer/slo_class_lookup.py, skymesh/slo_judge.py), counted by the balancer the client called:
        # requests admitted per class; how each ended (met every target it could be judged
        # on, missed one, rejected by the balancer, failed after its first byte); and which
        # targets were missed; cancelled: the client went away first. Attainment of a class =
        # met / its requests.
        self.slo_requests = Counter("skymesh_slo_requests_total", "Requests admitted per SLO class.",
                                    ("slo_class",), registry=None)
        self.slo_outcomes = Counter(
            "skymesh_slo_outcomes_total", "Requests of an SLO class by how they ended (met, missed, rejected, failed, cancelled).",
            ("slo_class", "outcome"), registry=None,
        )
        self.slo_target_misses = Counter(
            "skymesh_slo_target_misses_total", "Served requests that missed a target of their SLO class (ttft, tpot, e2e).",
            ("slo_class", "target"), registry=None,
        )
        # labelled children of the per-request metrics, by (metric, labels): see _child
        self._children: dict[tuple[int, tuple[str, ...]], Histogram | Counter] = {}
        # the HTTP edge's connection gauge and cap refusals (skymesh/edge/server.py)
        self.edge = EdgeMetrics.create(None, rejections=self.rejections, internal_errors=self.internal_errors)
        # registration order is the page's order: request-path metrics, then the load gauges
        self.registry.register(_WithoutCreatedSamples([
            self.client_ttft, self.client_tpot, self.client_e2e,
            self.decision_seconds, self.estimated_ttft, self.observed_ttft, self.prefix_hit_estimate,
            self.dispatches, self.retries, self.rejections, self.offloaded, self.midstream_failures,
            self.harmful_requests, self.context_refusals, self.requests_cut,
            self.internal_errors, self.config_reloads, self.cache_predictions, self.replica_pages,
            self.slo_requests, self.slo_outcomes, self.slo_target_misses,
            self.edge.connections_open, self.edge.connections_refused,
        ]))
        self.registry.register(_LoadCollector(region, snapshot))
        # the process: CPU seconds, resident memory, open files (Linux /proc), the Python
        # build and its garbage collector, as every prometheus_client process exports them
        ProcessCollector(registry=self.registry)
        self.registry.register(PLATFORM_COLLECTOR)
        self.registry.register(GC_COLLECTOR)

    def _child(self, metric: Histogram | Counter, *labels: str) -> Histogram | Counter:
        """``metric.labels(*labels)``, looked up once per label set (a series is never
        removed here, so the child stays the registry's): the requests' own metrics skip
        prometheus_client's per-call label checks and lock."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_client_latency(self, *, slo_class: str | None, served_by_peer: bool, e2e_s: float,
                               ttft_s: float | None, completion_tokens: int | None) -> None:
        """One served answer as its client saw it (``ttft_s`` None: not streamed)."""
        labels = (self.region, slo_class or NO_SLO_CLASS, "peer" if served_by_peer else "local")
        self._child(self.client_e2e, *labels).observe(e2e_s)  # type: ignore[union-attr]
        if ttft_s is None:
            return
        self._child(self.client_ttft, *labels).observe(ttft_s)  # type: ignore[union-attr]
        if completion_tokens is not None and completion_tokens > 1:
            self._child(self.client_tpot, *labels).observe(  # type: ignore[union-attr]
                (e2e_s - ttft_s) / (completion_tokens - 1))

    def observe_decision(self, req: RoutingRequest, d: Decision) -> None:
        self._child(self.dispatches, d.replica_id or "").inc()
        if d.estimated_ttft_s is not None:
            self.estimated_ttft.observe(d.estimated_ttft_s)
        if req.prompt_tokens:
            self.prefix_hit_estimate.observe(min(1.0, d.matched_tokens / req.prompt_tokens))
