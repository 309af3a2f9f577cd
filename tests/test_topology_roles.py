"""A replica's prefill/decode role reaches the region core from whichever source gave the
balancer the replica: the config for one it lists (its home region's entry, for one
adopted from another region), the controller's topology (``ReplicaAssignment.role``) for
one the config does not list (a registered replica), ``both`` where neither names one."""

from __future__ import annotations

import logging

import pytest

from skymesh.balancer.server import Balancer
from skymesh.config import parse_config
from skymesh.proto_gen import mesh_pb2
from tests.mesh_helpers import local_config_free_ports


def balancer_with_roles() -> Balancer:
    data = local_config_free_ports()
    us, eu = data["regions"][0], data["regions"][1]
    us["replicas"][0]["role"] = "prefill"
    eu["replicas"][1]["role"] = "decode"
    return Balancer(parse_config(data), us["name"])


def assignment(rid: str, home: str, role: str = "") -> mesh_pb2.ReplicaAssignment:
    return mesh_pb2.ReplicaAssignment(replica_id=rid, url=f"http://127.0.0.1:{9000 + len(rid)}", home_region=home,
                                      role=role)


def roles(b: Balancer) -> dict[str, str]:
    return {rid: b.core.local.role_of(rid) for rid in b.core.view.replicas}


def test_the_configs_roles_hold_at_start() -> None:
    b = balancer_with_roles()
    us = b.region_cfg
    assert roles(b) == {us.replicas[0].id: "prefill", us.replicas[1].id: "both", us.replicas[2].id: "both"}


def test_topology_roles_reach_the_core_for_adopted_and_registered_replicas(caplog: pytest.LogCaptureFixture) -> None:
    b = balancer_with_roles()
    cfg = b.cfg
    us, eu = cfg.regions[0], cfg.regions[1]
    topology = mesh_pb2.Topology(version=7, balancers=[mesh_pb2.BalancerAssignment(region=us.name, replicas=[
        # a controller before roles names none: the config's, wherever the replica is listed
        assignment(us.replicas[0].id, us.name),
        assignment(eu.replicas[1].id, eu.name),  # adopted from eu-west-1, decode there
        # the topology's own word wins, for a listed replica and a registered one alike
        assignment(us.replicas[1].id, us.name, "decode"),
        assignment("registered-7", us.name, "prefill"),
        assignment("registered-8", us.name),  # registered, no role: both
        assignment("registered-9", us.name, "kv_consumer"),  # unknown here: both, logged
    ])])
    with caplog.at_level(logging.WARNING, logger="skymesh.balancer"):
        b.controller_link_port.apply_topology(topology)
    assert roles(b) == {us.replicas[0].id: "prefill", eu.replicas[1].id: "decode", us.replicas[1].id: "decode",
                        "registered-7": "prefill", "registered-8": "both", "registered-9": "both"}
    assert any("unknown replica role" in r.getMessage() for r in caplog.records)
    # a later topology changes a role in place (the replica keeps its probe state)
    info = b.replicas["registered-7"]
    b.controller_link_port.apply_topology(mesh_pb2.Topology(version=8, balancers=[mesh_pb2.BalancerAssignment(
        region=us.name, replicas=[assignment("registered-7", us.name, "both")])]))
    assert roles(b) == {"registered-7": "both"} and b.replicas["registered-7"] is info
