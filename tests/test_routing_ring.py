"""Dual hash ring: distinct candidates, balance, minimal remapping on membership change."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.ring import DualHashRing


def keys(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 40), key=st.integers(0, 2**64 - 1))
def test_the_two_candidates_always_differ(n: int, key: int) -> None:
    ring = DualHashRing([f"r{i}" for i in range(n)], virtual_nodes=16)
    a, b = ring.candidates(key)
    assert a != b and {a, b} <= ring.members
    assert a == ring.primary(key)


@pytest.mark.parametrize("n", [4, 16, 64])
def test_keys_spread_evenly_over_replicas(n: int) -> None:
    ring = DualHashRing([f"r{i}" for i in range(n)])
    first: dict[str, int] = dict.fromkeys(ring.members, 0)
    either: dict[str, int] = dict.fromkeys(ring.members, 0)
    ks = keys(400 * n, n)
    for k in ks:
        a, b = ring.candidates(k)
        first[a] += 1
        either[a] += 1
        either[b] += 1
    for counts in (first, either):
        mean = sum(counts.values()) / n
        assert max(counts.values()) / mean < 1.35
        assert min(counts.values()) / mean > 0.65


@settings(max_examples=8, deadline=None)
@given(n=st.integers(3, 40))
def test_adding_a_replica_moves_about_one_over_n_plus_one(n: int) -> None:
    ring = DualHashRing([f"r{i}" for i in range(n)])
    ks = keys(4000, n)
    before = {k: ring.candidates(k) for k in ks}
    ring.add("new")
    moved_primary = 0
    for k in ks:
        after = ring.candidates(k)
        # a key's pair changes only by taking the new replica in
        assert set(after) - set(before[k]) <= {"new"}
        moved_primary += after[0] != before[k][0]
    share = moved_primary / len(ks)
    assert 0.4 / (n + 1) < share < 1.8 / (n + 1)


@settings(max_examples=8, deadline=None)
@given(n=st.integers(3, 40), victim=st.integers(0, 39))
def test_removing_a_replica_moves_only_its_keys(n: int, victim: int) -> None:
    ids = [f"r{i}" for i in range(n)]
    gone = ids[victim % n]
    ring = DualHashRing(ids)
    ks = keys(3000, n)
    before = {k: ring.candidates(k) for k in ks}
    ring.remove(gone)
    for k in ks:
        after = ring.candidates(k)
        if gone in before[k]:
            assert gone not in after
            # the surviving candidate stays one of the pair
            (kept,) = set(before[k]) - {gone}
            assert kept in after
        else:
            assert after == before[k]


def test_membership_order_does_not_matter() -> None:
    a = DualHashRing(["x", "y", "z"])
    b = DualHashRing(["z", "x", "y"])
    assert all(a.candidates(k) == b.candidates(k) for k in keys(500))


def test_walk_from_visits_every_replica_once_starting_at_the_primary() -> None:
    ring = DualHashRing([f"r{i}" for i in range(7)], virtual_nodes=8)
    for k in keys(50):
        order = list(ring.walk_from(k))
        assert order[0] == ring.primary(k)
        assert sorted(order) == sorted(ring.members)


def test_single_and_empty_rings() -> None:
    assert DualHashRing(["only"]).candidates(42) == ("only", "only")
    empty = DualHashRing()
    with pytest.raises(LookupError):
        empty.candidates(1)
    assert list(empty.walk_from(1)) == []
