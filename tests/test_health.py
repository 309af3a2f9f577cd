"""Replica health with hysteresis: the thresholds, and the dispatcher flags it alone writes."""

from __future__ import annotations

import ast
from pathlib import Path

from skymesh.routing.base import PolicyContext
from skymesh.routing.dispatcher import BalancerCore
from skymesh.routing.health import HealthChange, HealthSettings, ProbeSample, ReplicaHealth
from skymesh.routing.registry import make_policy

OK = ProbeSample()


def health(unhealthy: int = 3, healthy: int = 2) -> tuple[ReplicaHealth, BalancerCore]:
    dispatcher = BalancerCore(make_policy("least_load", PolicyContext()))
    dispatcher.set_replicas(["r0", "r1"])
    h = ReplicaHealth(dispatcher, HealthSettings(unhealthy_threshold=unhealthy, healthy_threshold=healthy))
    h.track(["r0", "r1"])
    return h, dispatcher


def test_a_new_replica_joins_on_its_first_good_probe() -> None:
    h, d = health()
    assert not d.replicas["r0"].healthy and h.any_usable(excluding=frozenset())  # unprobed: still usable
    assert h.probed("r0", OK) is HealthChange.HEALTHY
    assert d.replicas["r0"].healthy and d.replicas["r0"].available
    assert h.report("r0")["ejected"] is False


def test_unhealthy_threshold_consecutive_failures_eject() -> None:
    h, d = health(unhealthy=3)
    h.probed("r0", OK)
    assert h.failed("r0") is HealthChange.HELD
    assert d.replicas["r0"].healthy and not d.replicas["r0"].available  # held: no new work
    assert h.probed("r0", None) is HealthChange.HELD
    h.probed("r0", OK)  # a good probe resets the count
    assert [h.failed("r0") for _ in range(3)] == [HealthChange.HELD, HealthChange.HELD, HealthChange.EJECTED]
    assert not d.replicas["r0"].healthy and not d.replicas["r0"].available
    assert h.ejected_count() == 1 and h.report("r0")["ejections"] == 1
    assert h.failed("r0") is HealthChange.HELD  # already ejected: ejected once


def test_healthy_threshold_consecutive_good_probes_bring_it_back() -> None:
    h, d = health(unhealthy=1, healthy=2)
    h.probed("r0", OK)
    assert h.failed("r0") is HealthChange.EJECTED
    h.probed("r0", OK)
    assert not d.replicas["r0"].healthy  # one good probe is not enough
    h.probed("r0", None)
    h.probed("r0", OK)
    assert not d.replicas["r0"].healthy  # the failure reset the count
    h.probed("r0", OK)
    assert d.replicas["r0"].healthy and h.ejected_count() == 0


def test_usable_excludes_the_forbidden_and_the_ejected() -> None:
    h, _ = health(unhealthy=1)
    h.probed("r0", OK)
    h.probed("r1", OK)
    h.failed("r0")
    assert h.any_usable(excluding=frozenset())
    assert not h.any_usable(excluding=frozenset({"r1"}))


def test_unknown_replicas_change_nothing() -> None:
    h, _ = health()
    assert h.probed("nope", OK) is HealthChange.UNKNOWN
    assert h.failed("nope") is HealthChange.UNKNOWN
    h.forget("r0")
    assert h.report("r0") == {} and h.failed("r0") is HealthChange.UNKNOWN


def test_only_the_health_part_writes_the_dispatchers_health_flags() -> None:
    """Outside the dispatcher itself, no routing module assigns a replica's ``healthy`` or
    ``available`` flag, and only skymesh/routing/health.py calls the dispatcher's writers."""
    routing = Path(__file__).resolve().parent.parent / "skymesh" / "routing"
    writers = {"update_replica", "hold", "eject"}
    for path in sorted(routing.rglob("*.py")):
        if path.name == "dispatcher.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
            for target in targets:
                assert not (isinstance(target, ast.Attribute) and target.attr in {"healthy", "available"}), (
                    f"{path}:{node.lineno} writes a replica's health flag")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in writers:
                assert path.name == "health.py", f"{path}:{node.lineno} calls {node.func.attr}"
