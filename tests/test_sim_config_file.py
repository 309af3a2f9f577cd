"""``skymesh sim --config FILE`` and ``skymesh plan --config FILE``: the operator's own mesh
(its regions in order, latencies, replica counts, sim.profile, policy and offload rules)
instead of ``--regions`` (skymesh/bench/sim_setup.py, apply_config)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from skymesh.bench import sim_setup
from skymesh.bench.des import Simulator
from skymesh.cli import main

EU, US = "eu-central-1", "us-west-2"
RULE = '  rules:\n    - {from: "eu-*", to: ["eu-*"]}\n'


def mesh_yaml(tmp_path: Path, *, rules: str = RULE, name: str = "mesh.yaml", eu_profile: str = "tiny-test",
              extra: str = "") -> Path:
    """Two regions: eu-central-1 with 1 replica, us-west-2 with 2, 70 ms apart, TTFT SLO
    1.5 s, eu-* offloading only to eu-* (``rules``)."""
    text = f"""
regions:
  - name: {EU}
    source_networks: [10.1.0.0/16]
    balancer: {{listen: "127.0.0.1:18101", grpc_listen: "127.0.0.1:19101", peer_listen: "127.0.0.1:18104"}}
    replicas:
      - {{id: euc1-r0, sim: {{profile: {eu_profile}, port: 18201}}}}
  - name: {US}
    source_networks: [10.2.0.0/16]
    balancer: {{listen: "127.0.0.1:18102", grpc_listen: "127.0.0.1:19102", peer_listen: "127.0.0.1:18105"}}
    replicas:
      - {{id: usw2-r0, sim: {{profile: tiny-test, port: 18211}}}}
      - {{id: usw2-r1, sim: {{profile: tiny-test, port: 18212}}}}
latencies:
  - {{regions: [{EU}, {US}], one_way_ms: 70}}
controller: {{listen: "127.0.0.1:17001", http_listen: "127.0.0.1:17002"}}
dns: {{name: llm.example.test, listen: "127.0.0.1:15353"}}
policy: {{name: dualmap, ttft_slo_s: 1.5}}
offload:
  min_gain_s: 0.05
{rules}{extra}"""
    path = tmp_path / name
    path.write_text(text)
    return path


def skymesh(*argv: str) -> object:
    """The command's exit code (an int, or the message it exited with)."""
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code


def sim_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sim_setup.add_arguments(p)
    return p.parse_args(list(argv))


# eu's clients hold 90% of the sessions on its one replica, us's two replicas are nearly idle
DAY = ["--trace", "hot-prefix", "--requests", "200", "--rate", "10", "--block-size", "16", "--jobs", "1"]
EU_HEAVY = [*DAY, "--region-weights", "0.9,0.1"]


def test_sim_runs_the_config_mesh(tmp_path: Path) -> None:
    cfg = mesh_yaml(tmp_path)
    assert skymesh("sim", "--config", str(cfg), *DAY, "--out", str(tmp_path / "sim")) == 0
    report = json.loads((tmp_path / "sim" / "results.json").read_text())["config"]
    assert report["regions"] == [EU, US]
    assert report["replicas_per_region"] == {EU: 1, US: 2}
    assert report["profile"] == "tiny-test" and report["slo_s"] == 1.5
    assert report["residency"] == "eu-* stays in eu-*" and report["config"] == str(cfg)
    # what each simulated region core runs: the config's sections
    sim = sim_setup.sim_config(sim_args("--config", str(cfg), *DAY), "dualmap")
    assert sim.regions == {EU: 1, US: 2} and sim.profile == "tiny-test"
    assert sim.latency_s(EU, US) == sim.latency_s(US, EU) == pytest.approx(0.07)
    assert sim.routing.policy.ttft_slo_s == 1.5 and sim.routing.offload.min_gain_s == 0.05
    assert [(r.source, r.allowed_targets) for r in sim.routing.offload.rules] == [("eu-*", ("eu-*",))]
    # the command line still overrides what it names
    over = sim_setup.sim_config(sim_args("--config", str(cfg), *DAY, "--slo", "3", "--replicas", "4",
                                        "--region-replicas", f"{US}=1", "--offload-trigger", "saturated",
                                        "--profile", "h100-qwen2.5-7b"), "dualmap")
    assert over.routing.policy.ttft_slo_s == 3.0 and over.regions == {EU: 4, US: 1}
    assert over.routing.offload.trigger == "saturated" and over.profile == "h100-qwen2.5-7b"


def test_the_configs_residency_rule_binds_its_eu_clients(tmp_path: Path) -> None:
    def run(path: Path) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
        args = sim_args("--config", str(path), *EU_HEAVY)
        res = Simulator(sim_setup.sim_config(args, "dualmap")).run(sim_setup.build_trace(args, 3.0))
        return res.region_names, res.client_region, res.served_region

    names, client, served = run(mesh_yaml(tmp_path))
    assert names == (EU, US)
    eu = client == 0
    assert eu.sum() > 100 and (client == 1).any()
    assert (served[eu] == 0).all()  # no eu client served in us
    # the same mesh without the rule sends eu's overflow to us's idle replicas
    _, client, served = run(mesh_yaml(tmp_path, rules="", name="free.yaml"))
    assert (served[client == 0] == 1).sum() > 10


def test_local_default_as_a_config_is_the_three_region_layout(tmp_path: Path) -> None:
    """skymesh/local.yaml names the same regions, latencies, EU rule and queue defaults as
    ``--regions 3``: given as --config it simulates the very same mesh, request by request."""
    common = [*DAY, "--replicas", "1", "--skew", "0.6", "--profile", "tiny-test", "--slo", "1"]
    from_file = sim_args("--config", "skymesh/local.yaml", *common)
    built_in = sim_args("--regions", "3", *common)
    a_cfg, b_cfg = sim_setup.sim_config(from_file, "dualmap"), sim_setup.sim_config(built_in, "dualmap")
    assert list(a_cfg.regions) == list(b_cfg.regions) == ["us-east-1", "eu-west-1", "ap-northeast-1"]
    assert all(a_cfg.latency_s(x, y) == b_cfg.latency_s(x, y) > 0 for x in a_cfg.regions for y in a_cfg.regions
               if x != y)
    assert replace(a_cfg, one_way_ms={}) == replace(b_cfg, one_way_ms={})
    a, b = (sim_setup.run_one(x, "dualmap", 4.0, False) for x in (from_file, built_in))
    assert a["ttfts"] == b["ttfts"] and a["metrics"]["offloaded_share"] == b["metrics"]["offloaded_share"] > 0


def test_plan_lays_out_the_configs_regions(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    assert skymesh("plan", "--config", str(mesh_yaml(tmp_path)), "--trace", "hot-prefix", "--requests", "200",
                   "--rate", "12", "--hot-prompts", "12", "--diurnal-period-s", "30", "--rate-multiplier", "3",
                   "--max-replicas", "6", "--jobs", "1", "--out", str(out)) == 0
    report = json.loads((out / "plan.json").read_text())
    assert report["day"]["regions"] == [EU, US]
    for label in ("region-local", "mesh"):
        assert list(report["plans"][label]) == [EU, US]
        assert min(report["attainment"][label].values()) >= 0.9
    assert report["slo"]["ttft_s"] == 1.5 and report["slo"]["residency"] == "eu-* stays in eu-*"
    assert report["profile"] == "tiny-test"
    assert report["offloaded"]["mesh"][EU] == 0.0  # the rule held on the plan's own day


def test_config_refuses_options_that_describe_another_mesh(tmp_path: Path) -> None:
    cfg = str(mesh_yaml(tmp_path))
    for command, flag in (("sim", ["--regions", "3"]), ("plan", ["--regions", "2"]), ("plan", ["--no-eu-rule"])):
        message = str(skymesh(command, "--config", cfg, *DAY, *flag))
        assert flag[0] in message and "cannot be combined" in message and "the config names the regions" in message
    # the day's per-region options count the config's regions
    assert "--region-weights: 2" in str(skymesh("sim", "--config", cfg, *DAY, "--region-weights", "1,1,1"))
    assert "--phases: 2" in str(skymesh("sim", "--config", cfg, *DAY, "--phases", "0,0.3,0.6"))


def test_a_bad_config_reports_every_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = mesh_yaml(tmp_path, eu_profile="no-such-gpu", extra="  max_remote_queue: -1\n")
    assert skymesh("config", "--config", str(bad)) == 2
    expected = capsys.readouterr().err
    assert "config error: 2 errors:" in expected and "no-such-gpu" in expected and "max_remote_queue" in expected
    for command in ("sim", "plan"):
        assert skymesh(command, "--config", str(bad), *DAY, "--out", str(tmp_path / command)) == 2
        assert capsys.readouterr().err == expected
    assert not (tmp_path / "sim").exists() and not (tmp_path / "plan").exists()
    # replicas without one shared sim.profile: the profile must be named
    mixed = mesh_yaml(tmp_path, eu_profile="l4-llama3.1-8b", name="mixed.yaml")
    message = str(skymesh("sim", "--config", str(mixed), *DAY))
    assert "--profile" in message and "l4-llama3.1-8b, tiny-test" in message
