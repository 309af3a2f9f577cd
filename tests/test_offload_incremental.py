"""The offload router's kept state (the oldest live heartbeat, the peers said to be back)
answers every tick's questions exactly as a scan of every peer does, after any sequence of
heartbeats, deaths and returns."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.offload import OffloadRouter

PEERS = ["b", "c", "d", "e"]


def _newly_dead_by_scan(router: OffloadRouter, now: float) -> list[str]:
    return [r for r, p in router.peers.items()
            if not p.down and p.last_seen != float("-inf") and not router.is_fresh(r, now)]


def _lapsed_by_scan(router: OffloadRouter, now: float) -> list[str]:
    return [r for r, p in router.peers.items()
            if p.expected_until != float("-inf") and now >= p.expected_until and not router.is_fresh(r, now)]


@settings(max_examples=80, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_timed_out_and_lapsed_peers_equal_a_scan_after_every_event(seed: int) -> None:
    rng = random.Random(seed)
    router = OffloadRouter("a", {r: 0.01 for r in PEERS}, heartbeat_interval_s=0.1, miss_limit=3)
    now = 0.0
    for _ in range(300):
        now += rng.choice([0.0, 0.01, 0.05, 0.1, 0.29, 0.3, 0.31, 1.0, 12.0])
        kind = rng.randrange(5)
        region = rng.choice(PEERS)
        if kind == 0:
            router.update_peer(region, now=now, replicas_total=2, replicas_available=1)
        elif kind == 1:
            router.mark_down(region)
        elif kind == 2:
            router.expect(region, now, rng.randint(0, 2))
        elif kind == 3:
            expected = _lapsed_by_scan(router, now)
            assert router.lapsed_expectations(now) == expected
        assert router.newly_dead(now) == _newly_dead_by_scan(router, now)
        assert router._expecting == {r for r, p in router.peers.items() if p.expected_until != float("-inf")}


def test_a_peer_silent_past_the_miss_limit_is_newly_dead_until_declared_down() -> None:
    router = OffloadRouter("a", {"b": 0.01, "c": 0.01}, heartbeat_interval_s=0.1, miss_limit=3)
    router.update_peer("b", now=0.0, replicas_total=1)
    router.update_peer("c", now=0.2, replicas_total=1)
    assert router.newly_dead(0.3) == []
    assert router.newly_dead(0.45) == ["b"]
    router.mark_down("b")
    assert router.newly_dead(0.45) == []
    assert router.newly_dead(0.6) == ["c"]
    router.update_peer("b", now=0.6, replicas_total=1)
    assert router.newly_dead(0.6) == ["c"]
