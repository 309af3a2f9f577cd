"""The two retry budgets end a request at different points: ``max_retries`` counts failed
attempts on this region's replicas (abandoned ones are free), ``max_placements`` every
placement. Neither can stand in for the other."""

from __future__ import annotations

from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.region import ProbeSample, RegionCore, RegionSettings, Reject, SendToReplica
from skymesh.routing.registry import make_policy


def region(n: int, **settings: object) -> RegionCore:
    core = RegionCore("here", make_policy("least_load", PolicyContext()), OffloadRouter("here", {}, enabled=False),
                      RegionSettings(**settings))  # type: ignore[arg-type]
    core.set_replicas([f"r{i}" for i in range(n)], 0.0)
    return core


def place(core: RegionCore, now: float) -> str:
    for rid in core.replicas:
        core.probe(rid, ProbeSample(), now)
    (send,) = [a for a in core.tick(now) if isinstance(a, SendToReplica)]
    return send.replica_id


def attempts_until_rejected(core: RegionCore) -> int:
    core.submit(RoutingRequest("q0", (), 16, 0.0), 0.0)
    for attempt in range(1, 20):
        place(core, float(attempt))
        actions = core.fail("q0", float(attempt), reason="reset", counts_against_health=False)
        if any(isinstance(a, Reject) for a in actions):
            return attempt
    raise AssertionError("never rejected")


def test_max_retries_ends_a_request_before_max_placements() -> None:
    assert attempts_until_rejected(region(6, max_retries=2, max_placements=6)) == 3


def test_max_placements_ends_a_request_before_max_retries() -> None:
    assert attempts_until_rejected(region(6, max_retries=9, max_placements=2)) == 2


def failure_after_an_abandoned_attempt_rejects(core: RegionCore) -> bool:
    core.submit(RoutingRequest("q0", (), 16, 0.0), 0.0)
    first = place(core, 0.0)
    core.set_replicas([rid for rid in core.replicas if rid != first], 0.5)  # abandoned: queued again
    place(core, 1.0)
    return any(isinstance(a, Reject) for a in core.fail("q0", 1.0, reason="reset", counts_against_health=False))


def test_an_abandoned_attempt_spends_a_placement_not_a_retry() -> None:
    assert not failure_after_an_abandoned_attempt_rejects(region(4, max_retries=1, max_placements=9))
    assert failure_after_an_abandoned_attempt_rejects(region(4, max_retries=9, max_placements=2))
