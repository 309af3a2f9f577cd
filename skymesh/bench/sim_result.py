"""What a simulation run returns: per-request flat arrays and replica counters
(:class:`SimResult`), and the figures read from them (the metric set of
skymesh/bench/scores.py, per SLO class, and the cache-prediction accuracy).

Apart from the event loop so that reporting code reads results without the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from skymesh.bench.scores import class_summary, summarize_arrays
from skymesh.cache_prediction import over_block, within_block
from skymesh.config import SloClassConfig


@dataclass
class SimResult:
    """Per-request flat arrays (index = order of arrival) and replica counters."""

    arrival: np.ndarray
    ttft: np.ndarray  # NaN: no first token (rejected)
    e2e: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    rejected: np.ndarray
    offloaded: np.ndarray
    # per request: prefix tokens the policy expected to hit (its Decision.matched_tokens)
    # and those the engine served from its cache at first admission; NaN: never admitted
    predicted_cached: np.ndarray
    actual_cached: np.ndarray
    prefix_hit_rate: float
    load_cv: float | None
    load_series: list[tuple[float, list[int]]]  # (t, pending prefill tokens of the plotted replicas)
    plotted_replicas: list[str]
    events: int
    sim_time_s: float
    lazy_mismatches: int
    # per request: the index of its SLO class in ``slo_class_names``; -1: none
    slo_class: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int16))
    slo_class_names: tuple[str, ...] = ()
    slo_class_targets: tuple[SloClassConfig, ...] = ()
    # the most requests waiting in any replica's own queue (vllm:num_requests_waiting) at
    # any probe, and of those the most never admitted yet (pushed, not preempted back):
    # selective pushing keeps the latter within one dispatch budget
    max_replica_waiting: int = 0
    max_replica_unadmitted: int = 0
    # per request: the index in ``region_names`` of its client's region and of the region
    # whose replica served it (-1: rejected, never served)
    region_names: tuple[str, ...] = ()
    client_region: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int16))
    served_region: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int16))
    # per request: its TBT, the mean of its longest 10% token intervals (Mooncake's; 0 for
    # one output token); NaN: not recorded (``SimConfig.record_tbt``) or not served
    tbt: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # requests split into a prefill and a decode leg (skymesh/routing/pairing)
    split: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    # why the run ended before its last request ('': it ran to the end): its SLO verdict
    # was decided (skymesh/bench/verdict.py); the arrays then hold the requests that
    # arrived until then, and the verdict is the watch's, not these arrays' summary
    stopped_early: str = ""

    def region_summaries(self, slo_s: float, warmup_s: float = 0.0,
                         tbt_slo_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Per client region: the metric set of its own requests (attainment, TTFT, share
        offloaded, ...), as :meth:`summary` gives it for all."""
        out = {}
        for k, name in enumerate(self.region_names):
            sel = self.client_region == k
            out[name] = summarize_arrays(self.arrival[sel], self.ttft[sel], self.e2e[sel], self.output_len[sel],
                                         self.rejected[sel], self.offloaded[sel], slo_s, warmup_s=warmup_s,
                                         **self._tbt_judged(tbt_slo_s, sel))
        return out

    def _tbt_judged(self, tbt_slo_s: float | None, sel: np.ndarray | None = None) -> dict[str, Any]:
        """The TBT arguments of :func:`summarize_arrays`: none unless a target is given."""
        if tbt_slo_s is None:
            return {}
        if self.tbt.size != self.arrival.size or (np.isnan(self.tbt).all() and not self.rejected.all()):
            raise ValueError("a TBT target needs the run to record TBT (SimConfig.record_tbt)")
        return {"tbt": self.tbt if sel is None else self.tbt[sel], "tbt_slo_s": tbt_slo_s}

    def class_summaries(self, warmup_s: float = 0.0) -> dict[str, dict[str, Any]]:
        """Per SLO class: its requests, attainment (every target it can be judged on met;
        a rejected request misses), share rejected and mean / P90 latencies."""
        return {
            name: class_summary(self.arrival, self.ttft, self.e2e, self.output_len, self.rejected,
                                self.slo_class == k, targets, warmup_s=warmup_s)
            for k, (name, targets) in enumerate(zip(self.slo_class_names, self.slo_class_targets, strict=True))
        }

    def summary(self, slo_s: float, warmup_s: float = 0.0, tbt_slo_s: float | None = None) -> dict[str, Any]:
        """The metric set (skymesh/bench/scores.py); with ``tbt_slo_s`` a request meets the
        SLO only within both its TTFT and its TBT target."""
        out = summarize_arrays(self.arrival, self.ttft, self.e2e, self.output_len, self.rejected,
                               self.offloaded, slo_s, prefix_hit_rate=self.prefix_hit_rate,
                               load_cv_value=self.load_cv, warmup_s=warmup_s, **self._tbt_judged(tbt_slo_s))
        if self.split.any():
            out["split_share"] = round(float(self.split.mean()), 4)
        return out

    def prediction_accuracy(self, block_tokens: int, warmup_s: float = 0.0) -> float | None:
        """Share of admitted requests whose predicted cached prefix is within one block
        (``block_tokens``) of the engine's actual one."""
        ok = ~np.isnan(self.actual_cached) & ~np.isnan(self.predicted_cached) & (self.arrival >= warmup_s)
        if not ok.any():
            return None
        return float(np.mean(within_block(self.predicted_cached[ok], self.actual_cached[ok], block_tokens)))

    def prediction_over(self, block_tokens: int, warmup_s: float = 0.0) -> float | None:
        """Share of admitted requests whose predicted cached prefix exceeds the actual one
        by more than one block (the policy counted on blocks that were not there)."""
        ok = ~np.isnan(self.actual_cached) & ~np.isnan(self.predicted_cached) & (self.arrival >= warmup_s)
        if not ok.any():
            return None
        return round(float(np.mean(over_block(self.predicted_cached[ok], self.actual_cached[ok], block_tokens))), 4)
