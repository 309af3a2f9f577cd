"""A region core's settings: queue, retries, admission bounds, queue discipline, health.

The balancer's config (``upstream:``, ``queue:``, ``health:``) and the simulator's
scenarios build one :class:`RegionSettings`; :meth:`RegionCore.reconfigure
<skymesh.routing.region.RegionCore.reconfigure>` takes a new one on a reload.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from skymesh.routing.disciplines.base import DEFAULT_MAX_AGE_S
from skymesh.routing.disciplines.prefix_match import DEFAULT_PREFIX_TTFT_SHARE
from skymesh.routing.disciplines.slo_deadline import DEFAULT_ITERATIONS, DEFAULT_WINDOW
from skymesh.routing.health import HealthSettings
from skymesh.routing.queue_registry import DisciplineName


@dataclass(frozen=True, slots=True)
class RegionSettings:
    queue_bound: int = 1024
    dispatch_budget: int = 2
    lookahead: int = 64
    rebalance_interval_s: float = 0.05
    # the one retry budget: placements a request may get after its first, wherever they
    # go (a replica here or a peer region) and however the last one ended (it failed, or
    # the region abandoned it when its replica was ejected or left): a request is placed at
    # most max_retries + 1 times, so neither a flapping replica nor a refusing peer can
    # bounce it forever (docs/routing.md, "One retry budget")
    max_retries: int = 2
    # a request still queued this long after arrival gets 504 (None: wait forever, as the
    # simulator does for goodput sweeps)
    max_queue_wait_s: float | None = 60.0
    retry_after_s: float = 2.0
    # Mooncake's early rejection: a request whose SLO class's TTFT target no placement here
    # or at a peer is expected to meet gets 429 at once instead of queueing to a miss
    early_rejection: bool = True
    # the order within a priority, a name of skymesh/routing/queue_registry.py: "fcfs";
    # "slo" (skymesh/routing/disciplines/slo_deadline.py: each head of ``slo_window``
    # requests annealed for SLO attainment, ``slo_iterations`` evaluations a decision;
    # ``ttft_slo_s`` is the deadline of requests without a class); or "prefix" (FEATHER,
    # skymesh/routing/disciplines/prefix_match.py: a freed replica's best-matching queued
    # request first)
    queue_discipline: DisciplineName = "fcfs"
    slo_window: int = DEFAULT_WINDOW
    slo_iterations: int = DEFAULT_ITERATIONS
    ttft_slo_s: float = 2.0
    # the slo and prefix disciplines' starvation bound: queued this long, a request goes first
    slo_max_age_s: float = DEFAULT_MAX_AGE_S
    # the prefix discipline also puts a request first, in arrival order, once it has waited
    # this share of its TTFT target (its tail is bounded while the fresh ones match)
    prefix_ttft_share: float = DEFAULT_PREFIX_TTFT_SHARE
    health: HealthSettings = field(default_factory=HealthSettings)

    def queue_settings(self) -> dict[str, Any]:
        """The queue discipline's settings by the config's ``queue:`` keys (each discipline's
        options read theirs: skymesh/routing/queue_registry.py)."""
        return {"window": self.slo_window, "iterations": self.slo_iterations, "max_age_s": self.slo_max_age_s,
                "prefix_ttft_share": self.prefix_ttft_share}
