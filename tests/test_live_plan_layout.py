"""A plan's layout live: ``skymesh bench --regions 3 --region-replicas`` gives each region
of the local mesh its own stand-ins, and the live report judges each client region on its
own (attainment, share offloaded), as ``skymesh plan`` does in the simulator. Nothing here
starts a process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from skymesh.bench import live
from skymesh.bench.live_geo import geo_layout, geo_mesh_config, geo_regions
from skymesh.bench.loadgen import LiveResult
from skymesh.bench.scores import summarize
from skymesh.config import parse_config

# a one-request Mooncake trace: --trace's default lives outside the repository (a clean
# clone has none), and these tests parse the options without replaying anything
STUB_TRACE: list[Path] = []


@pytest.fixture(autouse=True, scope="module")
def _stub_trace(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("trace") / "one.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 300, "output_length": 8, "hash_ids": [1]}) + "\n")
    STUB_TRACE[:] = [path]


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    live.add_arguments(p)
    return p.parse_args(list(argv) if "--trace" in argv else ["--trace", str(STUB_TRACE[0]), *argv])


def test_the_parsed_layout_reaches_the_mesh_config(tmp_path: Path) -> None:
    args = _args("--regions", "3", "--replicas", "2", "--region-replicas", "eu-west-1=4,ap-northeast-1=1")
    layout = geo_layout(args)
    assert layout == {"us-east-1": 2, "eu-west-1": 4, "ap-northeast-1": 1}
    assert list(layout) == geo_regions()
    data = geo_mesh_config("dualmap", layout, "tiny-test", 0.5, 1.0, True, tmp_path)
    assert {r["name"]: len(r["replicas"]) for r in data["regions"]} == layout
    cfg = parse_config(data)  # a valid mesh: every stand-in its own id and port
    assert {r.name: len(r.replicas) for r in cfg.regions} == layout
    ids = [rep.id for r in cfg.regions for rep in r.replicas]
    assert len(set(ids)) == len(ids) == 7
    ports = [rep["sim"]["port"] for r in data["regions"] for rep in r["replicas"]]
    assert len(set(ports)) == len(ports)
    # one count for every region, as before
    uniform = geo_mesh_config("dualmap", 3, "tiny-test", 0.5, 1.0, True, tmp_path)
    assert [len(r["replicas"]) for r in uniform["regions"]] == [3, 3, 3]
    with pytest.raises(ValueError, match="each of"):
        geo_mesh_config("dualmap", {"us-east-1": 2}, "tiny-test", 0.5, 1.0, True, tmp_path)


def test_a_bad_layout_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="REGION=N"):
        geo_layout(_args("--regions", "3", "--region-replicas", "mars-1=3"))
    with pytest.raises(SystemExit, match="REGION=N"):
        geo_layout(_args("--regions", "3", "--region-replicas", "eu-west-1=0"))
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 300, "output_length": 8, "hash_ids": [1]}) + "\n")
    # one central router has no regions to give replicas to
    with pytest.raises(SystemExit, match="only with --regions 3"):
        live.run(_args("--trace", str(trace), "--requests", "1", "--region-replicas", "eu-west-1=2",
                       "--out", str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def _result(origin: str, ttft: float | None, offloaded: bool = False, rejected: bool = False) -> LiveResult:
    return LiveResult(arrival_s=0.1, input_len=100, output_len=4, origin=origin, ttft=ttft,
                      e2e=None if ttft is None else ttft + 0.1, rejected=rejected, offloaded=offloaded,
                      tokens=0 if ttft is None else 4)


def test_the_live_report_judges_each_client_region() -> None:
    results = [
        # us-east-1: 4 requests, 3 within the SLO (1.0 s), 2 of them served elsewhere
        _result("us-east-1", 0.5, offloaded=True), _result("us-east-1", 0.9, offloaded=True),
        _result("us-east-1", 0.2), _result("us-east-1", 1.5),
        # eu-west-1: 2 requests, one rejected (a miss)
        _result("eu-west-1", 0.3), _result("eu-west-1", None, rejected=True),
    ]
    regions = live.live_region_summaries(results, geo_regions(), 1.0)
    assert list(regions) == geo_regions()
    us, eu, ap = regions["us-east-1"], regions["eu-west-1"], regions["ap-northeast-1"]
    assert (us["requests"], us["slo_attainment"], us["offloaded_share"]) == (4, 0.75, 0.5)
    assert (eu["requests"], eu["slo_attainment"], eu["offloaded_share"], eu["rejected"]) == (2, 0.5, 0.0, 1)
    assert (ap["requests"], ap["slo_attainment"], ap["offloaded_share"]) == (0, 0.0, 0.0)
    # the same metric set as the whole run's, over the region's own requests
    assert us == summarize(results[:4], 1.0)
    # and the run's metrics carry them (the SLO scaled by the time scale)
    args = _args("--regions", "3", "--time-scale", "0.5", "--slo", "2")
    m = live._metrics(results, args, None, [])
    assert m["regions"] == regions
    assert m["slo_attainment"] == round(4 / 6, 4)
    lines = live.region_lines(m)
    assert lines[0].startswith("  us-east-1: requests=4 slo_attainment=0.75 offloaded_share=0.5")
    assert "regions" not in live._metrics(results, _args("--time-scale", "0.5", "--slo", "2"), None, [])


def test_the_simulator_s_report_judges_each_client_region_too() -> None:
    """``skymesh sim --regions 3`` reports the same per-region figures (the DES figure
    beside the live one), from ``SimResult.region_summaries``."""
    from skymesh.bench import sim_setup

    p = argparse.ArgumentParser()
    sim_setup.add_arguments(p)
    args = p.parse_args(["--trace", "hot-prefix", "--requests", "120", "--rate", "10", "--regions", "3",
                         "--replicas", "1", "--region-replicas", "us-east-1=2", "--skew", "0.6", "--profile",
                         "tiny-test", "--block-size", "16", "--slo", "1", "--jobs", "1"])
    m = sim_setup.run_one(args, "dualmap", 1.0, False)["metrics"]
    regions = m["regions"]
    assert list(regions) == ["us-east-1", "eu-west-1", "ap-northeast-1"]
    assert sum(r["requests"] for r in regions.values()) == m["requests"]
    met = sum(r["slo_attainment"] * r["requests"] for r in regions.values())
    assert met / m["requests"] == pytest.approx(m["slo_attainment"], abs=1e-3)
    off = sum(r["offloaded_share"] * r["requests"] for r in regions.values())
    assert off / m["requests"] == pytest.approx(m["offloaded_share"], abs=1e-3)
