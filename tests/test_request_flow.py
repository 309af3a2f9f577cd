"""The balancer's request flow carries out every word the region core says, in order,
even when the core says several before a handler runs again."""

from __future__ import annotations

import asyncio
import json

import pytest

from skymesh.balancer.metrics import BalancerMetrics, BalancerSnapshot
from skymesh.balancer.proxy import UpstreamTimeouts
from skymesh.balancer.request_flow import RequestFlow, Waiter
from skymesh.routing.heartbeat import HeartbeatSnapshot
from skymesh.routing.region_actions import AbandonAttempt, ForwardToRegion, Reject
from tests.test_region_core import eu_client, residency_core


def no_attempt(*args: object) -> None:
    raise AssertionError("an attempt was begun for a placement the core had taken back")


@pytest.mark.fault
async def test_a_forward_taken_back_before_its_attempt_began_is_never_sent_and_its_503_reaches_the_client() -> None:
    """The core forwards eu0 to eu-west-1 and wakes its handler; before the handler runs,
    eu-west-1 dies: the core takes the forward back and answers 503 (nothing else may serve
    an EU client). The handler must answer 503, not send the stale forward (a dead peer's
    failure would then find the request already answered, and leave its client waiting)."""
    core = residency_core("ap-northeast-1", {"ap0": "ap-northeast-1"}, peers={"eu-west-1": 0.22})
    core.peer_heartbeat("eu-west-1", HeartbeatSnapshot(3, 1, 0, 0), 0.0, epoch=1, seq=1)
    metrics = BalancerMetrics("ap-northeast-1", lambda: BalancerSnapshot(0, 0, 0, 0.0, [], []))
    flow = RequestFlow(core, metrics, asyncio.Event(), target=no_attempt, timeouts=UpstreamTimeouts,
                       chunk_tokens=lambda: 64, cache_source=lambda replica: "routing_history")
    eu0 = eu_client(0)
    waiter = flow.waiters[eu0.request_id] = Waiter()
    assert core.submit(eu0, 0.0) == []
    placed = core.tick(0.0)
    assert placed == [ForwardToRegion("eu0", "eu-west-1")]
    flow.apply(placed)  # the handler is woken, but has not run yet
    taken_back = core.peer_down("eu-west-1", 0.1)
    assert [type(a) for a in taken_back] == [AbandonAttempt, Reject]
    flow.apply(taken_back)
    response = await flow.serve(None, b"", eu0, False, waiter)  # type: ignore[arg-type]
    assert response.status == 503 and response.headers["Retry-After"]
    assert json.loads(response.body)["error"]["code"] == "no_capacity"
    assert core.view.state_of("eu0") is None
