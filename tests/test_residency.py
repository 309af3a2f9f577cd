"""Residency on its own (skymesh/routing/residency.py): which replicas a request may run
on, by each replica's home region and the offload rules."""

from __future__ import annotations

from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.dispatcher import BalancerCore
from skymesh.routing.health import HealthSettings, ProbeSample, ReplicaHealth
from skymesh.routing.model import RegionModel
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.registry import make_policy
from skymesh.routing.residency import Residency


def request(origin: str | None) -> RoutingRequest:
    return RoutingRequest("q", [1, 2], 128, 0.0, origin_region=origin)


def residency(allowed: set[tuple[str, str]]) -> tuple[Residency, OffloadRouter, ReplicaHealth]:
    """``here`` with its own replica ``h0`` and ``e0`` adopted from ``eu``."""
    queue = BalancerCore(make_policy("least_load", PolicyContext(model=RegionModel())))
    health = ReplicaHealth(queue, HealthSettings())
    offload = OffloadRouter("here", {}, enabled=False,
                            allowed=lambda src, dst: src == dst or (src, dst) in allowed)
    res = Residency("here", offload, health)
    queue.set_replicas(["h0", "e0"])
    health.track(["h0", "e0"])
    res.set_homes(["h0", "e0"], {"e0": "eu"})
    return res, offload, health


def test_a_closed_origin_never_gets_an_adopted_replica_and_the_own_clients_keep_theirs() -> None:
    res, _, _ = residency(allowed=set())
    assert res.adopted
    assert res.forbidden_replicas(request(None)) == frozenset({"e0"})  # here may not reach eu
    assert res.forbidden_replicas(request("eu")) == frozenset({"h0"})  # eu may not reach here


def test_new_rules_are_read_after_rules_changed() -> None:
    res, offload, _ = residency(allowed=set())
    assert res.forbidden_replicas(request(None)) == frozenset({"e0"})
    offload.allowed = lambda src, dst: True
    assert res.forbidden_replicas(request(None)) == frozenset({"e0"})  # cached per origin
    res.rules_changed()
    assert res.forbidden_replicas(request(None)) == frozenset()


def test_nothing_can_serve_only_when_every_allowed_replica_is_out_and_no_peer_could() -> None:
    res, _, health = residency(allowed=set())
    assert not res.nothing_can_serve(request(None), 0.0)  # unprobed replicas may still serve
    health.probed("h0", ProbeSample())
    for _ in range(HealthSettings().unhealthy_threshold):
        health.probed("h0", None)
    assert res.nothing_can_serve(request(None), 0.0)  # e0 is closed to it, offload is off
    for _ in range(HealthSettings().healthy_threshold):
        health.probed("h0", ProbeSample())
    assert not res.nothing_can_serve(request(None), 0.0)  # back in service


def test_the_503_says_where_a_request_may_run_and_that_none_of_it_is_reachable() -> None:
    # an EU client at a balancer whose own replica is closed to it and which holds none of
    # EU's (handed back): only eu may serve it, and eu's balancer is not heard from
    queue = BalancerCore(make_policy("least_load", PolicyContext(model=RegionModel())))
    health = ReplicaHealth(queue, HealthSettings())
    offload = OffloadRouter("here", {"eu": 0.05}, enabled=True, allowed=lambda src, dst: src == dst)
    res = Residency("here", offload, health)
    queue.set_replicas(["h0"])
    health.track(["h0"])
    res.set_homes(["h0"], None)
    assert res.nothing_can_serve(request("eu"), 0.0)
    why = res.why_nothing_can_serve(request("eu"), 0.0)
    assert why.startswith("requests from eu may run in eu only; every replica here is closed to it")
    assert "Retry-After" in why
