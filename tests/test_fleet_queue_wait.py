"""benchmarks/fleet_queue_wait.py times placements per balancer and leaves the routing
code as it found it."""

from __future__ import annotations

import json

import pytest

from benchmarks import fleet_queue_wait
from skymesh.routing.dispatcher import BalancerCore
from skymesh.routing.region import RegionCore

# a generated workload (the default trace lives beside the clone, not in it)
SMALL_DAY = ["--trace", "hot-prefix", "--requests", "150", "--rate", "10", "--regions", "2", "--replicas", "2",
             "--profile", "tiny-test", "--block-size", "16", "--slo", "1", "--rates", "1", "--seed", "0",
             "--systems", "dualmap", "--jobs", "1"]


def test_each_balancer_of_the_region_gets_its_placements_timed(capsys: pytest.CaptureFixture[str]) -> None:
    submit, dispatch = RegionCore.submit, BalancerCore.dispatch
    assert fleet_queue_wait.main(["--region", "r1", "--", *SMALL_DAY, "--balancers-per-region", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    per = out["queue_wait_per_balancer"]
    assert set(per) == {"r1-b0", "r1-b1"}
    # the entry hands requests to the balancers in turn: both place about half
    assert all(p["placements"] > 0 for p in per.values())
    assert out["queue_wait"]["placements"] == sum(p["placements"] for p in per.values())
    assert 0.0 <= out["queue_wait"]["p50_s"] <= out["queue_wait"]["p90_s"] <= out["queue_wait"]["p99_s"]
    # the wrapping is undone
    assert (RegionCore.submit, BalancerCore.dispatch) == (submit, dispatch)


def test_one_system_one_rate_and_a_simulated_region(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        fleet_queue_wait.main(["--region", "r1", "--", *SMALL_DAY, "--rates", "1,2"])
    assert "one system and one rate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fleet_queue_wait.main(["--region", "us-east-1", "--", *SMALL_DAY])
    assert "r0, r1" in capsys.readouterr().err
