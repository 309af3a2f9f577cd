"""The balancer core: selective pushing, retries, bookkeeping that returns to zero."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.dispatcher import BalancerCore, QueueFull
from skymesh.routing.hashing import prompt_chunk_hashes
from skymesh.routing.registry import make_policy


def req(i: int, now: float = 0.0, prefix: int = 0, tokens: int = 256) -> RoutingRequest:
    text = " ".join([f"p{prefix}w{k}" for k in range(tokens - 8)] + [f"r{i}w{k}" for k in range(8)])
    return RoutingRequest(
        request_id=f"q{i}", chunk_hashes=prompt_chunk_hashes(text, 64), prompt_tokens=tokens, arrival=now
    )


def core(policy: str = "least_load", n: int = 3, budget: int = 2, bound: int = 100) -> BalancerCore:
    c = BalancerCore(make_policy(policy, PolicyContext()), queue_bound=bound, dispatch_budget=budget)
    c.set_replicas([f"r{i}" for i in range(n)])
    return c


def probe_all(c: BalancerCore, waiting: dict[str, int] | None = None) -> None:
    """Every replica's page shows every request this balancer has in flight there as
    running (plus ``waiting`` more)."""
    for rid, v in c.replicas.items():
        c.update_replica(rid, healthy=True, num_running=v.in_flight, num_waiting=(waiting or {}).get(rid, 0))


def test_new_replicas_wait_for_their_first_probe() -> None:
    c = core()
    c.submit(req(0))
    assert c.dispatch(0.0) == []
    probe_all(c)
    assert len(c.dispatch(0.0)) == 1


def test_pushed_requests_a_probe_does_not_show_stay_charged_to_the_budget() -> None:
    c = core(n=1, budget=2)
    probe_all(c)
    for i in range(6):
        c.submit(req(i))
    assert len(c.dispatch(0.0)) == 2
    # the page was built before the two arrived: 0 running, 0 waiting. Resetting the
    # budget would push two more on top of them (4 unadmitted, budget 2)
    c.update_replica("r0", healthy=True, num_running=0, num_waiting=0)
    assert c.dispatch(0.1) == []
    # one of them shows: one unit of budget back
    c.update_replica("r0", healthy=True, num_running=1, num_waiting=0)
    assert len(c.dispatch(0.2)) == 1
    assert c.dispatch(0.2) == []
    # the oldest, which the page showed, fails before its first token: its unit was
    # given back by the page already, so nothing more comes back (two unseen pushes left)
    first, second, _ = c._in_flight
    c.on_complete(first, False, 0.3)
    assert c.dispatch(0.3) == []
    # one the page did not show fails too: its unit comes back
    c.on_complete(second, False, 0.4)
    assert len(c.dispatch(0.4)) == 1


def test_a_first_token_of_a_request_the_page_showed_gives_no_second_unit_back() -> None:
    """The page's credit and the first token would both return the same unit: a lone
    balancer could then push past its budget onto a full replica."""
    c = core(n=1, budget=2)
    probe_all(c)
    for i in range(6):
        c.submit(req(i))
    first_two = [r.request_id for r, _ in c.dispatch(0.0)]
    assert len(first_two) == 2
    probe_all(c)  # the page shows both running: their units come back
    assert len(c.dispatch(0.1)) == 2  # two more pushed, not on the page yet
    c.on_first_token(first_two[0], 0.2)  # one of those the page showed starts
    assert c.dispatch(0.2) == []  # still two unseen pushes: the budget
    c.on_first_token(first_two[1], 0.3)
    assert c.dispatch(0.3) == []
    unseen = [rid for rid in c._in_flight if rid not in first_two]
    c.on_first_token(unseen[0], 0.4)  # an unseen one starts: one unit back
    assert len(c.dispatch(0.4)) == 1


def test_replica_with_waiting_requests_is_not_available() -> None:
    c = core(n=2)
    probe_all(c, {"r0": 3})
    for i in range(2):
        c.submit(req(i))
    placed = c.dispatch(0.0)
    assert {d.replica_id for _, d in placed} == {"r1"}


def test_dispatch_budget_stops_overfilling_between_probes() -> None:
    c = core(n=2, budget=2)
    probe_all(c)
    for i in range(10):
        c.submit(req(i, prefix=i))
    placed = c.dispatch(0.0)
    assert len(placed) == 4  # 2 replicas x budget 2
    assert c.queue_length == 6
    assert not c.any_available()
    # a first token proves admission: one unit of budget comes back
    c.on_first_token(placed[0][0].request_id, 0.3)
    assert len(c.dispatch(0.3)) == 1
    probe_all(c)  # the next probe resets the budget
    assert len(c.dispatch(0.4)) == 4


def test_queue_bound() -> None:
    c = core(bound=2)
    c.submit(req(0))
    c.submit(req(1))
    with pytest.raises(QueueFull):
        c.submit(req(2))
    assert c.counters.rejected_queue_full == 1


def test_retry_goes_to_head_and_never_to_the_failed_replica() -> None:
    c = core(n=2, budget=1)
    probe_all(c)
    c.submit(req(0))
    (r, d), = c.dispatch(0.0)
    failed = d.replica_id
    c.submit(req(1))
    assert c.retry(r.request_id, 0.1)
    assert c.queued_requests()[0].request_id == r.request_id  # back at the head
    probe_all(c)  # even once the failed replica looks healthy again...
    placed = dict((q.request_id, dd.replica_id) for q, dd in c.dispatch(0.2))
    assert placed[r.request_id] != failed  # ...the retry avoids it


def test_a_retry_of_a_request_not_in_flight_changes_nothing() -> None:
    """The dispatcher requeues what it has in flight; the retry budget is the region
    core's (tests/test_retry_budgets.py)."""
    c = BalancerCore(make_policy("round_robin", PolicyContext()), dispatch_budget=5)
    c.set_replicas(["a", "b"])
    probe_all(c)
    c.submit(req(0))
    (r, _), = c.dispatch(0.0)
    assert c.retry(r.request_id, 0.0)
    assert not c.retry(r.request_id, 0.0)  # queued now, not in flight
    assert [q.request_id for q in c.queued_requests()] == [r.request_id]
    assert c.counters.retried == 1 and all(v.in_flight == 0 for v in c.replicas.values())


def test_cancel_removes_queued_or_in_flight() -> None:
    c = core(n=1, budget=1)
    probe_all(c)
    c.submit(req(0))
    c.submit(req(1))
    (r0, _), = c.dispatch(0.0)
    c.cancel("q1", 0.0)
    assert c.queue_length == 0
    c.cancel(r0.request_id, 0.0)
    v = c.replicas["r0"]
    assert v.in_flight == 0 and v.pending_prefill_tokens == 0


def test_removed_replica_leaves_membership() -> None:
    c = core(n=3)
    probe_all(c)
    c.set_replicas(["r0", "r2"])
    for i in range(4):
        c.submit(req(i, prefix=i))
    assert {d.replica_id for _, d in c.dispatch(0.0)} <= {"r0", "r2"}


OPS = st.lists(
    st.tuples(st.sampled_from(["submit", "dispatch", "first", "done", "fail", "retry", "cancel", "probe"]),
              st.integers(0, 15)),
    max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, policy=st.sampled_from(["least_load", "round_robin", "prefix_tree", "dualmap", "cache_aware"]))
def test_bookkeeping_returns_to_zero_after_any_path(ops: list[tuple[str, int]], policy: str) -> None:
    c = core(policy=policy, n=3, budget=2)
    probe_all(c)
    now = 0.0
    seen: set[int] = set()
    for op, i in ops:
        now += 0.01
        rid = f"q{i}"
        if op == "submit" and i not in seen:
            seen.add(i)
            c.submit(req(i, now, prefix=i % 3))
        elif op == "dispatch":
            c.dispatch(now)
        elif op == "first":
            c.on_first_token(rid, now)
        elif op == "done":
            c.on_complete(rid, True, now)
        elif op == "fail":
            c.on_complete(rid, False, now)
        elif op == "retry":
            c.retry(rid, now)
        elif op == "cancel":
            c.cancel(rid, now)
        elif op == "probe":
            probe_all(c)
        for v in c.replicas.values():
            assert v.in_flight >= 0 and v.pending_prefill_tokens >= 0
        # the running sum equals the queue's own
        assert c.queued_prefill_tokens() == sum(r.prompt_tokens for r in c.queued_requests())
    for i in seen:
        c.cancel(f"q{i}", now)
    assert c.queue_length == 0 and c.in_flight_count == 0 and c.queued_prefill_tokens() == 0
    assert all(v.in_flight == 0 and v.pending_prefill_tokens == 0 for v in c.replicas.values())


def test_sustainable_rate_counts_what_unsaturated_replicas_can_take() -> None:
    c = core(n=3, budget=2)
    assert c.sustainable_dispatch_rate(0.0, 0.1) == 0.0  # nothing probed: nothing known
    probe_all(c, waiting={"r2": 3})  # r2 has requests waiting in its own queue: saturated
    assert c.sustainable_dispatch_rate(0.0, 0.1) == pytest.approx(2 * 2 / 0.1)
    for i in range(4):
        c.submit(req(i))
    assert len(c.dispatch(1.0)) == 4  # r0 and r1 spend their budgets at t = 1
    # just spent: the predicted first token brings a unit back; spent for 2 s with none
    # back: that replica is taken at no more than its budget per 2 s
    assert c.sustainable_dispatch_rate(1.0, 0.1) == pytest.approx(2 * 2 / 0.1)
    assert c.sustainable_dispatch_rate(3.0, 0.1) == pytest.approx(2 * 2 / 2.0)
    c.hold("r0")  # a failed probe: no signal to go by
    assert c.sustainable_dispatch_rate(3.0, 0.1) == pytest.approx(2 / 2.0)
    probe_all(c)  # every page shows what was pushed: budgets back, r2 no longer waiting
    assert c.sustainable_dispatch_rate(3.0, 0.1) == pytest.approx(3 * 2 / 0.1)
