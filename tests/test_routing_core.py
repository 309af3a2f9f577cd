"""Property and rule tests of the routing core: hashing, trie, ring, TTFT model."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.hashing import chunk_hashes, prompt_chunk_hashes
from skymesh.routing.hotness import HotnessTree
from skymesh.routing.ring import DualHashRing
from skymesh.routing.trie import BoundedPrefixTrie
from skymesh.routing.ttft import TTFTEstimator


def test_chunk_hashes_are_cumulative_prefix_ids() -> None:
    a = prompt_chunk_hashes(" ".join(f"w{i}" for i in range(130)), 64)
    b = prompt_chunk_hashes(" ".join(f"w{i}" for i in range(128)) + " x y", 64)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    c = prompt_chunk_hashes("z " + " ".join(f"w{i}" for i in range(129)), 64)
    assert all(x != y for x, y in zip(a, c, strict=True))  # a different start changes every id
    assert chunk_hashes([], 64) == ()


@settings(max_examples=30, deadline=None)
@given(st.integers(10, 2000), st.integers(0, 2**32))
def test_trie_stays_bounded_under_unique_prompts(max_nodes: int, seed: int) -> None:
    rng = random.Random(seed)
    t = BoundedPrefixTrie(max_nodes)
    for i in range(400):
        chunks = tuple(rng.getrandbits(63) for _ in range(rng.randint(1, 12)))
        t.insert(chunks, f"r{i % 5}")
        assert len(t) <= max_nodes


def test_trie_bound_with_endless_unique_stream() -> None:
    t = BoundedPrefixTrie(1000)
    shared = tuple(range(1, 5))
    for i in range(50_000):
        t.insert(shared + (10_000 + 3 * i, 10_001 + 3 * i), "r0")
    assert len(t) <= 1000
    # the hot shared prefix survives eviction (it is refreshed by every insert)
    assert t.longest_match(shared + (7,), {"r0"})[0] == 4


def test_trie_longest_match_and_early_stop() -> None:
    t = BoundedPrefixTrie(100)
    t.insert((1, 2, 3, 4), "a")
    t.insert((1, 2), "b")
    assert t.longest_match((1, 2, 3, 4, 5), {"a", "b"}) == (4, {"a"})
    assert t.longest_match((1, 2, 3, 4), {"b"}) == (2, {"b"})  # stops once no "b" below
    assert t.longest_match((1, 2, 3), {"c"}) == (0, set())
    assert t.match_per_target((1, 2, 3, 9), ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
    t.remove_target("a")
    assert t.longest_match((1, 2, 3, 4), {"a", "b"}) == (2, {"b"})


def keys(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def test_ring_candidates_distinct_and_balanced() -> None:
    ring = DualHashRing([f"r{i}" for i in range(16)])
    counts: dict[str, int] = {}
    for k in keys(40_000):
        a, b = ring.candidates(k)
        assert a != b
        counts[a] = counts.get(a, 0) + 1
    mean = 40_000 / 16
    assert max(counts.values()) < 1.35 * mean and min(counts.values()) > 0.65 * mean


@settings(max_examples=10, deadline=None)
@given(st.integers(3, 40))
def test_ring_add_remaps_about_one_over_n_plus_one(n: int) -> None:
    ring = DualHashRing([f"r{i}" for i in range(n)])
    ks = keys(6000, n)
    before = {k: ring.primary(k) for k in ks}
    ring.add("new")
    moved = [k for k in ks if ring.primary(k) != before[k]]
    assert all(ring.primary(k) == "new" for k in moved)  # only keys the new node took
    share = len(moved) / len(ks)
    assert share < 2.0 / (n + 1)


def test_ring_remove_moves_only_the_removed_replicas_keys() -> None:
    ring = DualHashRing([f"r{i}" for i in range(10)])
    ks = keys(5000)
    before = {k: ring.candidates(k) for k in ks}
    ring.remove("r3")
    for k in ks:
        if "r3" not in before[k]:
            assert ring.candidates(k) == before[k]


def test_ring_single_replica() -> None:
    ring = DualHashRing(["only"])
    assert ring.candidates(42) == ("only", "only")


def test_ttft_estimator_converges_from_a_wrong_seed() -> None:
    est = TTFTEstimator(s_per_token=1e-2, fixed_s=1.0)  # 20x off
    rng = random.Random(1)
    for _ in range(3000):
        ahead, uncached = rng.randint(0, 4000), rng.randint(0, 2000)
        est.observe(ahead, uncached, 0.03 + 5e-4 * (ahead + uncached) + rng.gauss(0, 0.005))
    assert abs(est.s_per_token - 5e-4) < 5e-5
    assert abs(est.fixed_s - 0.03) < 0.02
    assert abs(est.estimate(1000, 500) - (0.03 + 0.75)) < 0.08


def test_hotness_grows_hot_prefixes_and_cools_them() -> None:
    h = HotnessTree(base_chunks=1, window=200)
    hot = (1, 2, 3, 4)
    for i in range(100):
        h.observe(hot[:1] + (1000 + i, 5000 + i), 8)  # one system prompt, varied turns
    assert h.key_length(hot, 8) >= 2  # hot: keyed deeper so its traffic splits
    for i in range(400):
        h.observe((7000 + i, 9000 + i), 8)  # traffic moves elsewhere
    assert h.key_length(hot, 8) == 1
