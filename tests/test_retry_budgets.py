"""One retry budget, the region core's: ``max_retries`` placements after the first,
wherever they go (a replica here, a peer region) and however the last one ended (failed,
or abandoned when its replica was ejected or left membership)."""

from __future__ import annotations

from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.health import ProbeSample
from skymesh.routing.heartbeat import HeartbeatSnapshot
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.region import RegionCore
from skymesh.routing.region_actions import ForwardToRegion, Reject, SendToReplica
from skymesh.routing.region_settings import RegionSettings
from skymesh.routing.registry import make_policy


def region(n: int, *, max_retries: int, peers: dict[str, float] | None = None, dispatch_budget: int = 2) -> RegionCore:
    core = RegionCore("here", make_policy("least_load", PolicyContext()),
                      OffloadRouter("here", peers or {}, enabled=bool(peers)),
                      RegionSettings(max_retries=max_retries, dispatch_budget=dispatch_budget))
    core.set_replicas([f"r{i}" for i in range(n)], 0.0)
    return core


def place(core: RegionCore, now: float) -> str:
    for rid in core.view.replicas:
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


def test_a_request_gets_max_retries_plus_one_placements() -> None:
    assert attempts_until_rejected(region(6, max_retries=0)) == 1
    assert attempts_until_rejected(region(6, max_retries=2)) == 3
    assert attempts_until_rejected(region(6, max_retries=4)) == 5


def test_an_abandoned_attempt_spends_the_budget() -> None:
    """A replica that leaves (or is ejected) while a request waits for its first byte:
    the request is placed again, and that placement counts."""
    core = region(4, max_retries=1)
    core.submit(RoutingRequest("q0", (), 16, 0.0), 0.0)
    first = place(core, 0.0)
    core.set_replicas([rid for rid in core.view.replicas if rid != first], 0.5)  # abandoned: queued again
    place(core, 1.0)
    (reject,) = core.fail("q0", 1.0, reason="reset", counts_against_health=False)
    assert isinstance(reject, Reject) and reject.status == 502


def test_a_failed_forward_and_a_failed_replica_share_one_budget() -> None:
    core = region(1, max_retries=1, peers={"there": 0.05}, dispatch_budget=1)
    for rid in core.view.replicas:
        core.probe(rid, ProbeSample(), 0.0)
    core.peer_heartbeat("there", HeartbeatSnapshot(4, 4, 0, 0), 0.0, epoch=1, seq=1)
    core.submit(RoutingRequest("busy", (), 16, 0.0), 0.0)
    core.submit(RoutingRequest("q0", (1,), 16, 0.0), 0.0)
    assert ForwardToRegion("q0", "there") in core.tick(0.0)  # the replica is busy: offloaded
    assert core.fail("q0", 0.1, reason="HTTP 503") == []  # the peer failed: served here instead
    core.complete("busy", 0.2)
    assert place(core, 0.3) == "r0"
    (reject,) = core.fail("q0", 0.4, reason="reset", counts_against_health=False)
    assert isinstance(reject, Reject) and reject.status == 502


def test_an_abandonment_past_the_budget_is_answered_at_once() -> None:
    """A replica leaving under a request that has had all its placements: 502 now, not a
    requeue that would let membership churn place it forever."""
    core = region(2, max_retries=0)
    core.submit(RoutingRequest("q0", (), 16, 0.0), 0.0)
    first = place(core, 0.0)
    actions = core.set_replicas([rid for rid in core.view.replicas if rid != first], 0.5)
    assert [type(a).__name__ for a in actions] == ["AbandonAttempt", "Reject"]
    assert actions[1].status == 502 and core.view.active_requests == 0 and core.view.queue_length == 0


def test_the_replica_that_spent_the_budget_gets_no_new_work_until_a_good_probe() -> None:
    core = region(2, max_retries=0)
    core.submit(RoutingRequest("q0", (), 16, 0.0), 0.0)
    failed = place(core, 0.0)
    (reject,) = core.fail("q0", 0.1, reason="reset", counts_against_health=False)
    assert isinstance(reject, Reject) and not core.view.replicas[failed].available
    core.probe(failed, ProbeSample(), 0.2)
    assert core.view.replicas[failed].available
