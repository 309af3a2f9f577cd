"""The day's shape (skymesh/bench/day_shape.py): the options sim, bench and plan share."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from skymesh.bench.day_shape import add_day_arguments, day_shape
from skymesh.bench.traces import TraceRequest, assign_regions, diurnal

REGIONS = ["a", "b", "c"]


def shape_of(*argv: str, n: int = 3):
    p = argparse.ArgumentParser()
    add_day_arguments(p)
    return day_shape(p.parse_args(list(argv)), n)


def requests(n: int = 30_000, sessions: int = 3000) -> list[TraceRequest]:
    return [TraceRequest(i * 0.01, 10, 1, (i,), session=i % sessions) for i in range(n)]


def test_the_default_shape_is_the_old_one_request_for_request() -> None:
    """Without the new options a day draws exactly what skew / amplitude / period drew."""
    reqs = requests()
    shape = shape_of("--skew", "0.3", "--diurnal-period-s", "100", "--amplitude", "0.7")
    old = diurnal(assign_regions(reqs, REGIONS, 0.3, 5), REGIONS, 100.0, 0.7, seed=5)
    assert shape.apply(reqs, REGIONS, 5) == old


def test_region_weights_share_the_sessions() -> None:
    out = shape_of("--region-weights", "1,0,3").apply(requests(), REGIONS, 1)
    regions_of_sessions = {r.session: r.region for r in out}
    counts = Counter(regions_of_sessions.values())
    assert counts["b"] == 0
    assert 2.5 < counts["c"] / counts["a"] < 3.5
    # a session stays in one region
    assert len({(r.session, r.region) for r in out}) == len(regions_of_sessions)


def test_each_region_has_its_own_amplitude_and_phase() -> None:
    reqs = requests()  # 300 s of arrivals, 100 per second
    out = shape_of("--region-weights", "1,1,1", "--diurnal-period-s", "300", "--amplitude", "0,1,0.8",
                   "--phases", "0,0.5,0.5").apply(reqs, REGIONS, 2)
    total = Counter(r.region for r in reqs_assigned(reqs))
    kept = Counter(r.region for r in out)
    # amplitude 0: a flat curve keeps every request of its region
    assert kept["a"] == total["a"]

    def share(region: str, lo: float, hi: float) -> int:
        return sum(1 for r in out if r.region == region and lo <= r.arrival_s < hi)
    # b peaks half a period in (t = 150 s) and at amplitude 1 falls to nothing at t = 0
    assert share("b", 125, 175) > 10 * share("b", 0, 25)
    # c too, but its trough keeps a fifth of the peak
    assert share("c", 0, 25) > 0.1 * share("c", 137.5, 162.5)


def reqs_assigned(reqs: list[TraceRequest]) -> list[TraceRequest]:
    return shape_of("--region-weights", "1,1,1").apply(reqs, REGIONS, 2)


@pytest.mark.parametrize("argv, option", [
    (("--region-weights", "1,2"), "--region-weights"),
    (("--region-weights", "1,-1,1"), "--region-weights"),
    (("--region-weights", "1,1,1", "--skew", "0.5"), "--skew"),
    (("--amplitude", "0.5,0.5"), "--amplitude"),
    (("--amplitude", "1.5"), "--amplitude"),
    (("--phases", "0,0.5"), "--phases"),
    (("--phases", "0,x,1"), "--phases"),
    (("--skew", "1.0"), "--skew"),
])
def test_a_shape_that_does_not_fit_names_its_option(argv: tuple[str, ...], option: str) -> None:
    with pytest.raises(SystemExit) as e:
        shape_of(*argv)
    assert option in str(e.value)
