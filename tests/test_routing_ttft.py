"""TTFT estimator: seeded by the profile, refitted online by least squares."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.ttft import TTFTEstimator


def feed(est: TTFTEstimator, slope: float, fixed: float, n: int, seed: int, noise: float) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        ahead, uncached = rng.randint(0, 4000), rng.randint(0, 2000)
        est.observe(ahead, uncached, fixed + slope * (ahead + uncached) + rng.gauss(0, noise))


def test_before_any_observation_the_estimate_is_the_seed_line() -> None:
    est = TTFTEstimator(s_per_token=1e-3, fixed_s=0.05)
    assert est.estimate(100, 400) == 0.05 + 1e-3 * 500
    assert est.estimate(-5, -7) == 0.05  # negative counts are treated as none
    assert est.prefill_s(1000) == 1.0


@settings(max_examples=12, deadline=None)
@given(
    seed_slope_factor=st.floats(0.05, 20.0),
    seed_fixed=st.floats(0.0, 2.0),
    true_slope=st.floats(1e-4, 2e-3),
    true_fixed=st.floats(0.005, 0.2),
)
def test_converges_to_the_true_linear_model_from_any_seed(
    seed_slope_factor: float, seed_fixed: float, true_slope: float, true_fixed: float
) -> None:
    est = TTFTEstimator(s_per_token=true_slope * seed_slope_factor, fixed_s=seed_fixed)
    feed(est, true_slope, true_fixed, n=2500, seed=3, noise=0.002)
    assert abs(est.s_per_token - true_slope) < 0.05 * true_slope
    assert abs(est.fixed_s - true_fixed) < 0.02 + 0.1 * true_fixed
    expected = true_fixed + true_slope * 1500
    assert abs(est.estimate(1000, 500) - expected) < 0.05 * expected
    assert est.observations == 2500


def test_follows_a_change_of_hardware_speed() -> None:
    est = TTFTEstimator(s_per_token=5e-4, fixed_s=0.02)
    feed(est, 5e-4, 0.02, n=1500, seed=1, noise=0.001)
    feed(est, 1e-3, 0.02, n=3000, seed=2, noise=0.001)  # the replica got twice as slow
    assert abs(est.s_per_token - 1e-3) < 1e-4


def test_nonsense_observations_do_not_break_the_model() -> None:
    est = TTFTEstimator(s_per_token=5e-4, fixed_s=0.02)
    est.observe(100, 100, -1.0)  # a negative ttft is a clock glitch: ignored
    assert est.observations == 0
    for _ in range(50):  # all at one x: the slope is unidentifiable, keep the last sane fit
        est.observe(0, 0, 0.5)
    assert est.s_per_token > 0 and est.fixed_s >= 0
    assert est.estimate(0, 1000) > est.estimate(0, 10)
