"""benchmarks/fleet_capacity.py: the region it builds and the summary it reports (the
live run itself is the benchmark: docs/benchmarks.md, "A region is a fleet (live)")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.fleet_capacity import (
    REGION,
    messages_sent_by_reason,
    parse_args,
    region_config,
    summarize,
)
from skymesh.config import parse_config


def test_the_region_has_the_asked_members_over_the_same_fast_replicas(tmp_path: Path) -> None:
    for n in (1, 2, 3):
        cfg = parse_config(region_config(n, 0.1, tmp_path, sibling_interval_s=0.1 if n == 3 else None))
        region = cfg.region(REGION)
        assert [r.name for r in cfg.regions] == [REGION]
        assert len(region.balancer_members) == n
        assert len(region.replicas) == 3
        assert all(r.sim is not None and r.sim.profile == "tiny-test" and r.sim.time_scale == 0.1
                   for r in region.replicas)
        assert cfg.siblings.interval_s == (0.1 if n == 3 else 0.02)


def run(n: int, cpu_us: float, idle: float, waiting: float, rps: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"balancers": n, "idle_cpu_per_s": idle, "max_num_requests_waiting": waiting,
                           "moderate": {"cpu_us_per_request": cpu_us, "cpu_us_per_request_less_idle": cpu_us / 2}}
    if rps is not None:
        out["saturation"] = {"rps": rps, "cpu_us_per_request": cpu_us, "balancers_cpu_s": 5.0, "wall_s": 10.0}
    return out


def test_the_summary_is_each_rounds_ratio_to_one_balancer_and_the_projection() -> None:
    runs = [run(1, 1000, 0.03, 1, 100), run(2, 1100, 0.1, 2, 90),
            run(1, 2000, 0.03, 2, 80), run(2, 3000, 0.1, 2, 70)]
    s = summarize(runs, [1, 2])
    assert s["2"]["ratio_to_1_per_round"] == [1.1, 1.5]
    assert s["2"]["ratio_to_1_median"] == round(2050 / 1500, 3)
    assert s["1"]["max_num_requests_waiting"] == 2 and s["2"]["saturation_rps"] == [90, 70]
    assert s["2"]["saturation_balancer_cores"] == [0.5, 0.5]
    assert s["projection"]["rps_per_balancer_core_from_moderate_1"] == round(1e6 / 1500, 1)
    assert s["projection"]["rps_at_2_balancer_cores"] == round(2e6 / 2050, 1)


def test_the_defaults_are_a_moderate_rate_and_saturation_with_one_and_two() -> None:
    a = parse_args([])
    assert (a.rounds, a.variants, a.saturate, a.rate, a.duration, a.users, a.time_scale) == (
        3, [1, 2, 3], [1, 2], 100.0, 10.0, 48, 0.1)


def test_messages_sent_by_reason_are_per_member_per_second_over_the_window() -> None:
    before = [{"channel": {"sent_grants": 10, "sent_pages": 4, "applied": 50}},
              {"channel": {"sent_grants": 2, "sent_keepalive": 1}}]
    after = [{"channel": {"sent_grants": 30, "sent_pages": 4, "applied": 90}},
             {"channel": {"sent_grants": 12, "sent_keepalive": 5, "sent_wants": 2}}]
    # over 2 s and 2 members: grants (20 + 10) / 2 / 2, keepalives 4 / 2 / 2, wants 2 / 2 / 2;
    # a reason that sent nothing in the window is left out, and other counts are not reasons
    assert messages_sent_by_reason(before, after, 2.0) == {"grants": 7.5, "keepalive": 1.0, "wants": 0.5}
    # a lone balancer has no channel
    assert messages_sent_by_reason([{}], [{}], 1.0) == {}
