"""Metric definitions on tiny hand-made inputs with known answers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from skymesh.bench.scores import (
    cv,
    goodput,
    load_cv,
    monotone_goodput,
    percentile,
    slo_attainment,
    summarize,
    summarize_arrays,
)


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


def test_monotone_goodput_stops_at_the_first_failing_rate() -> None:
    # preble's sweep from issue 13: passes, fails, passes again near the cliff
    sweep = [(10.94, 0.99), (11.33, 0.976), (11.72, 0.796), (12.11, 0.958)]
    assert goodput(sweep) == 12.11  # the non-monotone rule counts the lucky point
    assert monotone_goodput(sweep) == pytest.approx(11.33 + 0.39 * (0.976 - 0.9) / (0.976 - 0.796))
    # adding points can lower it, never raise it past a failure
    assert monotone_goodput([*sweep, (11.5, 0.85)]) < monotone_goodput(sweep)
    assert monotone_goodput([(1, 0.8), (2, 0.95)]) == 0.0
    assert monotone_goodput([(2, 1.0), (1, 1.0)]) == 2


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


def test_cv() -> None:
    assert cv([]) is None and cv([0, 0]) is None
    assert cv([1, 3]) == pytest.approx(0.5)


def test_summarize_excludes_warmup_and_reports_e2e_and_itl() -> None:
    @dataclass
    class L(R):
        itl: list[float] | None = None

    rs = [L(0.0, 5.0, 6.0), L(10.0, 1.0, 2.0, itl=[0.1, 0.3]), L(11.0, 3.0, 4.0, itl=[0.2])]
    s = summarize(rs, slo_s=2.0, warmup_s=5.0)
    assert s["requests"] == 2 and s["slo_attainment"] == 0.5
    assert s["e2e_p50"] == 2.0 and s["e2e_p99"] == 4.0
    assert s["itl_p50"] == pytest.approx(0.2)
    assert s["throughput"] == pytest.approx(20 / 5.0)  # from t=10 to t=15


def test_summarize_arrays_nan_means_missing() -> None:
    nan = float("nan")
    s = summarize_arrays(np.array([0.0, 1.0, 2.0, 3.0]), np.array([0.1, 0.2, nan, 0.9]),
                         np.array([1.0, 1.0, nan, 2.0]), np.array([5.0, 5.0, 5.0, 5.0]),
                         np.array([False, False, True, False]), np.array([False, True, False, False]), 0.5,
                         prefix_hit_rate=0.5, load_cv_value=0.25)
    assert s["slo_attainment"] == 0.5 and s["rejected"] == 1 and s["completed"] == 3
    assert s["ttft_p90"] == 0.9 and s["offloaded_share"] == 0.25 and s["load_cv"] == 0.25
    assert s["throughput"] == pytest.approx(15 / 5.0)
