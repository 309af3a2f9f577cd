"""A region is a fleet: several active-active balancers behind the region's entry
(config members, `skymesh balancer --member K`, the controller's per-member view)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from skymesh.balancer.main import as_member, member_balancer_id, with_listen_ports
from skymesh.config import HostPort, MeshConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "configs" / "local-fleet.yaml"


def fleet_config() -> MeshConfig:
    return load_config(FLEET)


def test_member_k_listens_on_its_sibling_entry_and_keeps_the_region_entry() -> None:
    cfg = fleet_config()
    b = as_member(cfg, "eu-west-1", 1).region("eu-west-1").balancer
    sib = cfg.region("eu-west-1").balancer.siblings[0]
    assert (b.listen, b.grpc_listen, b.peer_listen) == (sib.listen, sib.grpc_listen, sib.peer_listen)
    entry = cfg.region("eu-west-1").balancer
    assert (b.advertise, b.grpc_advertise, b.peer_advertise) == (entry.advertise, entry.grpc_advertise,
                                                                 entry.peer_advertise)
    # the other regions are untouched; member 0 is the config itself
    assert as_member(cfg, "eu-west-1", 1).region("us-east-1") == cfg.region("us-east-1")
    assert as_member(cfg, "eu-west-1", 0) is cfg
    # the port overrides apply on top of the member's listeners
    moved = with_listen_ports(as_member(cfg, "eu-west-1", 1), "eu-west-1", 0, None).region("eu-west-1").balancer
    assert moved.listen == HostPort(sib.listen.host, 0) and moved.grpc_listen == sib.grpc_listen


def test_a_member_is_named_by_its_id_and_a_lone_balancer_as_before() -> None:
    cfg = fleet_config()
    assert member_balancer_id(cfg, "us-east-1", 1, None) == "us-east-1-b1"
    assert member_balancer_id(cfg, "us-east-1", 0, None) == "us-east-1-b0"
    assert member_balancer_id(cfg, "us-east-1", 1, "mine") == "mine"
    lone = load_config(ROOT / "configs" / "local.yaml")
    assert member_balancer_id(lone, "us-east-1", 0, None) is None  # a fresh id per process


def test_a_member_the_region_does_not_have_is_a_config_error() -> None:
    done = subprocess.run([sys.executable, "-m", "skymesh.cli", "balancer", "--config", str(FLEET),
                           "--region", "us-east-1", "--member", "2"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "has 2 balancer(s)" in done.stderr and "no member 2" in done.stderr
