"""Metric definitions on tiny hand-made inputs with known answers."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from skymesh.bench.metrics import goodput, load_cv, percentile, slo_attainment, summarize
from skymesh.bench.traces import TraceRequest, assign_regions, oracle_hit_rate, scale_rate


@dataclass
class R:
    arrival_s: float
    ttft: float | None
    e2e: float | None
    output_len: int = 10
    rejected: bool = False
    offloaded: bool = False


def test_percentile_nearest_rank() -> None:
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile([1, 2, 3, 4], 90) == 4
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([], 50) is None


def test_slo_attainment_counts_failures_as_misses() -> None:
    assert slo_attainment([0.5, 1.0, 2.5, None], 2.0) == 0.5
    assert slo_attainment([], 2.0) == 0.0


def test_goodput_takes_highest_rate_meeting_90_percent_and_interpolates() -> None:
    assert goodput([(1, 1.0), (2, 0.95), (4, 0.5)]) == pytest.approx(2 + 2 * (0.95 - 0.9) / (0.95 - 0.5))
    assert goodput([(1, 0.8), (2, 0.7)]) == 0.0
    assert goodput([(1, 1.0), (2, 1.0)]) == 2


def test_load_cv() -> None:
    assert load_cv([{"a": 10, "b": 10}]) == 0.0
    assert load_cv([{"a": 0, "b": 20}]) == pytest.approx(1.0)  # mean 10, std 10
    assert load_cv([{"a": 0, "b": 0}, {"a": 0, "b": 20}]) == pytest.approx(1.0)  # idle samples skipped


def test_summarize_known_answers() -> None:
    rs = [R(0.0, 0.5, 1.0), R(1.0, 3.0, 4.0, offloaded=True), R(2.0, None, None, rejected=True)]
    s = summarize(rs, slo_s=2.0, prefix_hit_rate=0.25)
    assert s["slo_attainment"] == pytest.approx(1 / 3, abs=1e-4)
    assert s["completed"] == 2 and s["rejected"] == 1
    assert s["throughput"] == pytest.approx(20 / 5.0)  # 20 tokens from t=0 to t=5
    assert s["offloaded_share"] == pytest.approx(1 / 3, abs=1e-4)
    assert s["ttft_p50"] == 0.5


def test_oracle_hit_rate_and_trace_helpers() -> None:
    reqs = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 1536, 1, (1, 2, 3)), TraceRequest(2, 512, 1, (9,), session=9)]
    assert oracle_hit_rate(reqs) == pytest.approx(2 / 6)
    assert [r.arrival_s for r in scale_rate(reqs, 2.0)] == [0, 0.5, 1.0]
    by_region = assign_regions([TraceRequest(i, 10, 1, (i % 3,), session=i % 3) for i in range(30)], ["a", "b"], seed=1)
    sessions: dict[int, set[str]] = {}
    for r in by_region:
        sessions.setdefault(r.session, set()).add(r.region)
    assert all(len(v) == 1 for v in sessions.values())  # a session stays in its region
