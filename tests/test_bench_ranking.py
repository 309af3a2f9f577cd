"""Goodput by bisection and rankings that need every variant to agree (skymesh/bench/ranking.py)."""

from __future__ import annotations

import pytest

from skymesh.bench.ranking import bisect_goodput, ranking_statements


def cliff(at: float) -> object:
    return lambda rate: 1.0 if rate <= at else 0.5


@pytest.mark.parametrize("true_cliff", [0.3, 1.0, 3.3, 7.9])
def test_bisection_finds_the_cliff_to_the_resolution(true_cliff: float) -> None:
    s = bisect_goodput(cliff(true_cliff), resolution=0.05)  # type: ignore[arg-type]
    assert s.goodput <= true_cliff < s.goodput * 1.05 + 1e-12
    lo, hi = s.bracket
    assert hi is not None and lo == s.goodput and hi > true_cliff
    # every evaluated rate at or below the answer passed
    assert all(att >= 0.9 for rate, att in s.evaluated if rate <= s.goodput)


def test_a_pass_past_a_failure_never_counts() -> None:
    # passes at 1, fails at 2, passes again at 4 (noise near the cliff)
    def att(rate: float) -> float:
        return 1.0 if rate <= 1.2 or 3.5 <= rate <= 5 else 0.0

    s = bisect_goodput(att, resolution=0.02)
    assert 1.17 < s.goodput <= 1.2
    assert all(rate < 2.01 for rate, _ in s.evaluated)


def test_nothing_passes_and_everything_passes() -> None:
    assert bisect_goodput(lambda r: 0.0).goodput == 0.0
    s = bisect_goodput(lambda r: 1.0, max_rate=8.0)
    assert s.goodput == 8.0 and s.bracket == (8.0, None)
    with pytest.raises(ValueError):
        bisect_goodput(lambda r: 1.0, resolution=0.0)


def test_a_ranking_is_stated_only_when_every_variant_agrees() -> None:
    claims = ranking_statements({"a": [10.0, 11.0, 12.0], "b": [9.0, 10.0, 11.0], "c": [10.2, 9.0, 12.1]}, 0.05)
    assert "a > b (every variant, by more than 5%)" in claims
    assert any(c.startswith("a ~ c: not separated") for c in claims)
    # c beats b on two variants of three: no claim
    assert any(c.startswith("b ~ c: not separated (b ahead in 1, c in 2 of 3") for c in claims)
