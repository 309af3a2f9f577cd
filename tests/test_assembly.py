"""One assembly: the balancer daemon and the simulator build a region's routing core from
the same typed settings (skymesh/assembly.py, skymesh/routing/assembly.py), so a mesh
config simulated is the mesh config run; only the simulator's declared choices differ."""

from __future__ import annotations

from dataclasses import replace

import pytest

from skymesh.assembly import RoutingConfig, cost_seed, max_queue_wait_s, region_assembly
from skymesh.bench.sim_config import SimConfig, sim_region_assembly
from skymesh.config import MeshConfig, parse_config
from skymesh.config.routing import PolicyConfig, UpstreamConfig
from skymesh.hardware import PROFILES
from skymesh.routing.assembly import build_region_core
from tests.mesh_helpers import local_config_free_ports


@pytest.fixture(scope="module")
def mesh() -> MeshConfig:
    return parse_config(local_config_free_ports())


def simulated(cfg: MeshConfig) -> SimConfig:
    """The mesh ``cfg`` as the simulator runs it: its regions, links and routing."""
    names = [r.name for r in cfg.regions]
    links = {(a, b): cfg.one_way_ms(a, b) for a in names for b in names if a < b}
    profile = next(rep.sim.profile for r in cfg.regions for rep in r.replicas if rep.sim is not None)
    return SimConfig(regions={r.name: len(r.replicas) for r in cfg.regions}, one_way_ms=links, profile=profile,
                     routing=RoutingConfig.of(cfg))


@pytest.mark.parametrize("region", ["us-east-1", "eu-west-1"])
def test_the_simulator_builds_a_region_as_the_daemon_does(mesh: MeshConfig, region: str) -> None:
    daemon = region_assembly(mesh, region, mesh.policy.name, kv_events=False)
    sim = sim_region_assembly(simulated(mesh), region, daemon.cost_seed)
    # the simulator's one declared difference: no queue-wait deadline (goodput sweeps)
    assert sim == replace(daemon, settings=replace(daemon.settings, max_queue_wait_s=None))


def test_link_rtt_is_twice_the_configured_one_way_latency(mesh: MeshConfig) -> None:
    core = build_region_core(region_assembly(mesh, "us-east-1", mesh.policy.name, kv_events=False))
    expected = {r.name: mesh.rtt_ms("us-east-1", r.name) / 1000 for r in mesh.regions if r.name != "us-east-1"}
    assert core.offload.rtt_s == expected


def test_the_cost_seed_is_the_replicas_profile_at_their_time_scale(mesh: MeshConfig) -> None:
    replicas = mesh.region("us-east-1").replicas
    sim = replicas[0].sim
    assert sim is not None
    seed = cost_seed(replicas)
    assert (seed.prefill_s_per_token, seed.first_token_fixed_s) == PROFILES[sim.profile].ttft_seed(sim.time_scale)


def test_the_queue_wait_deadline_defaults_to_thirty_ttft_targets_and_at_least_a_minute() -> None:
    assert max_queue_wait_s(PolicyConfig(ttft_slo_s=1.0), UpstreamConfig()) == 60.0
    assert max_queue_wait_s(PolicyConfig(ttft_slo_s=4.0), UpstreamConfig()) == 120.0
    assert max_queue_wait_s(PolicyConfig(ttft_slo_s=4.0), UpstreamConfig(max_queue_wait_s=5.0)) == 5.0
