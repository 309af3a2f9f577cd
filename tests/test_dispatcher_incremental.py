"""The dispatcher's incrementally kept counts equal their plain recomputation after every
event: the available replicas and their free dispatch slots (read by offload and the
dispatch loop on every tick instead of scanning every replica)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.dispatcher import BalancerCore
from skymesh.routing.hashing import prompt_chunk_hashes
from skymesh.routing.registry import make_policy

REPLICAS = [f"r{i}" for i in range(6)]


def _request(i: int, now: float) -> RoutingRequest:
    text = " ".join(f"p{i % 3}w{k}" for k in range(200))
    return RoutingRequest(request_id=f"q{i}", chunk_hashes=prompt_chunk_hashes(text, 64), prompt_tokens=200,
                          arrival=now)


def _assert_counts_match_a_scan(c: BalancerCore) -> None:
    views = c.replicas.values()
    assert c.any_available() == any(v.available for v in views)
    assert c.available_count() == sum(1 for v in views if v.available)
    assert c.free_dispatch_slots() == sum(
        max(0, c.budget.free_slots(v.replica_id)) for v in views if v.available)
    assert c._available_ids == {v.replica_id for v in views if v.available}


def _random_event(c: BalancerCore, rng: random.Random, now: float, next_id: int) -> int:
    """One event of the kinds that move availability or a budget's charge."""
    kind = rng.randrange(12)
    in_flight = list(c._in_flight)
    rid = rng.choice(REPLICAS)
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            c.submit(_request(next_id, now))
            next_id += 1
    elif kind == 1:
        c.dispatch(now)
    elif kind == 2 and rid in c.replicas:
        v = c.replicas[rid]
        c.update_replica(rid, healthy=rng.random() < 0.9, num_running=rng.randint(0, max(0, v.in_flight) + 1),
                         num_waiting=rng.choice([0, 0, 0, 1, 2]))
    elif kind == 3 and in_flight:
        c.on_first_token(rng.choice(in_flight), now)
    elif kind == 4 and in_flight:
        c.on_complete(rng.choice(in_flight), rng.random() < 0.9, now)
    elif kind == 5 and in_flight:
        c.retry(rng.choice(in_flight), now)
    elif kind == 6:
        c.hold(rid)
    elif kind == 7 and rid in c.replicas:
        c.eject(rid)
    elif kind == 8:
        c.set_draining(rng.sample(REPLICAS, rng.randint(0, 2)))
    elif kind == 9:
        c.set_replicas(rng.sample(REPLICAS, rng.randint(3, len(REPLICAS))))
    elif kind == 10 and in_flight:
        c.give_up(rng.choice(in_flight), now)
    elif kind == 11:
        c.dispatch_budget = rng.randint(1, 4)  # a config reload
    return next_id


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), budget=st.integers(1, 3))
def test_available_replicas_and_free_slots_equal_a_scan_after_every_event(seed: int, budget: int) -> None:
    rng = random.Random(seed)
    c = BalancerCore(make_policy("least_load", PolicyContext()), queue_bound=10_000, dispatch_budget=budget)
    c.set_replicas(REPLICAS)
    _assert_counts_match_a_scan(c)
    next_id = 0
    for step in range(300):
        next_id = _random_event(c, rng, step * 0.01, next_id)
        _assert_counts_match_a_scan(c)


def test_a_dispatch_round_fills_every_free_slot_it_counted() -> None:
    c = BalancerCore(make_policy("least_load", PolicyContext()), queue_bound=100, dispatch_budget=2)
    c.set_replicas(REPLICAS[:3])
    for rid in REPLICAS[:3]:
        c.update_replica(rid, healthy=True)
    assert c.free_dispatch_slots() == 6 and c.available_count() == 3
    for i in range(10):
        c.submit(_request(i, 0.0))
    assert len(c.dispatch(0.0)) == 6
    assert c.free_dispatch_slots() == 0 and not c.any_available()
