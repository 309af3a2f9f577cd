"""Bounded prefix trie: the hard bound, LRU-leaf eviction, longest match, early stop."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.trie import BoundedPrefixTrie


def assert_consistent(t: BoundedPrefixTrie) -> None:
    """The structure the O(1) eviction and the bottom-up lookups rely on."""
    nodes, parents, children = t._targets, t._parent, t._children
    assert len(nodes) <= t.max_nodes
    assert set(parents) == set(nodes)
    counted: dict[int, int] = {}
    for h, p in parents.items():
        if p is not None:
            assert p in nodes  # never orphaned
            assert set(nodes[h]) <= set(nodes[p])  # a holder holds every ancestor
            counted[p] = counted.get(p, 0) + 1
    assert counted == children
    assert set(t._leaves) == set(nodes) - set(children)


def test_endless_unique_prompts_stay_under_the_bound() -> None:
    t = BoundedPrefixTrie(1000)
    rng = random.Random(7)
    system = tuple(rng.getrandbits(64) for _ in range(4))
    for i in range(50_000):
        suffix = tuple(rng.getrandbits(64) for _ in range(rng.randint(1, 4)))
        t.insert(system + suffix, f"r{i % 8}", float(i))
        assert len(t) <= 1000
    assert t.evictions > 0
    assert_consistent(t)
    # the shared system prompt is refreshed by every insert: it survives eviction
    assert t.longest_match(system + (1,), {"r0", "r5"})[0] == 4


@settings(max_examples=40, deadline=None)
@given(
    max_nodes=st.integers(1, 60),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "insert", "insert", "remove"]),
            st.lists(st.integers(0, 3), min_size=0, max_size=9),  # a path in a 4-ary tree
            st.sampled_from(["a", "b", "c"]),
        ),
        max_size=60,
    ),
)
def test_random_operations_keep_the_bound_and_the_structure(
    max_nodes: int, ops: list[tuple[str, list[int], str]]
) -> None:
    t = BoundedPrefixTrie(max_nodes)
    for step, (op, path, target) in enumerate(ops):
        if op == "insert":
            # cumulative ids: a node id names its whole prefix, like chunk_hashes does
            chunks = tuple(hash(tuple(path[: i + 1])) for i in range(len(path)))
            t.insert(chunks, target, float(step))
            if chunks:  # the prompt just inserted is never the one evicted
                assert t.longest_match(chunks, {target})[0] == min(len(chunks), max_nodes)
        else:
            t.remove_target(target)
        assert_consistent(t)


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=6), st.sampled_from("abcd")),
        max_size=25,
    ),
    query=st.lists(st.integers(0, 2), max_size=8),
    alive=st.sets(st.sampled_from("abcde")),
)
def test_matches_agree_with_a_brute_force_model(
    prompts: list[tuple[list[int], str]], query: list[int], alive: set[str]
) -> None:
    def ids(path: list[int]) -> tuple[int, ...]:
        return tuple(hash(("p", *path[: i + 1])) for i in range(len(path)))

    t = BoundedPrefixTrie(10_000)  # no eviction: the model is every prompt ever inserted
    for path, target in prompts:
        t.insert(ids(path), target, 0.0)

    def held(target: str) -> int:
        return max(
            (
                n
                for path, tg in prompts
                if tg == target
                for n in range(len(path) + 1)
                if path[:n] == query[:n]
            ),
            default=0,
        )

    per = t.match_per_target(ids(query), alive)
    assert per == {x: held(x) for x in alive}
    depth, owners = t.longest_match(ids(query), alive)
    assert depth == max(per.values(), default=0)
    assert owners == ({x for x in alive if per[x] == depth} if depth else set())


def test_longest_match_stops_where_no_available_target_remains() -> None:
    t = BoundedPrefixTrie(100)
    t.insert((1, 2, 3, 4, 5, 6), "busy", 0.0)
    t.insert((1, 2), "free", 0.0)
    t.insert((1, 2, 3), "other", 0.0)
    # the deeper nodes belong to replicas that are not available: they do not count
    assert t.longest_match((1, 2, 3, 4, 5, 6), {"free"}) == (2, {"free"})
    assert t.longest_match((1, 2, 3, 4, 5, 6), {"free", "other"}) == (3, {"other"})
    assert t.longest_match((1, 2, 3, 4, 5, 6), {"busy", "free"}) == (6, {"busy"})
    assert t.longest_match((1, 2, 3), {"nobody"}) == (0, set())
    assert t.longest_match((1, 2, 3), set()) == (0, set())
    assert t.longest_match((9, 2, 3), {"busy"}) == (0, set())  # a different first chunk
    assert t.match_per_target((1, 2, 3, 9), ["busy", "free", "x"]) == {"busy": 3, "free": 2, "x": 0}


def test_the_least_recently_used_leaf_goes_first() -> None:
    t = BoundedPrefixTrie(4)
    t.insert((1, 10), "a", 0.0)
    t.insert((1, 20), "b", 1.0)
    t.insert((1, 10), "a", 2.0)  # refreshes leaf 10: leaf 20 is now the oldest
    t.insert((1, 30), "c", 3.0)  # fits (4 nodes)
    t.insert((1, 40), "d", 4.0)  # one over: evicts 20
    assert 20 not in t and all(h in t for h in (1, 10, 30, 40))
    assert t.targets_at(1) == {"a": 2.0, "b": 1.0, "c": 3.0, "d": 4.0}


def test_interior_nodes_go_only_after_their_children() -> None:
    t = BoundedPrefixTrie(3)
    t.insert((1, 2, 3), "a", 0.0)
    t.insert((7,), "b", 1.0)  # evicts leaf 3; 2 becomes a leaf and is oldest
    assert 3 not in t and 2 in t and 7 in t
    t.insert((8,), "b", 2.0)  # evicts 2 (then 1 would be next), never an orphan
    assert 2 not in t and 1 in t and len(t) == 3
    assert_consistent(t)


def test_a_path_longer_than_the_bound_keeps_its_head() -> None:
    t = BoundedPrefixTrie(5)
    t.insert(tuple(range(1, 21)), "a", 0.0)
    assert len(t) == 5 and t.longest_match(tuple(range(1, 21)), {"a"}) == (5, {"a"})


def test_remove_target_forgets_a_replica_everywhere() -> None:
    t = BoundedPrefixTrie(100)
    t.insert((1, 2, 3), "a", 0.0)
    t.insert((1, 2), "b", 0.0)
    t.remove_target("a")
    assert t.longest_match((1, 2, 3), {"a", "b"}) == (2, {"b"})
    assert t.match_per_target((1, 2, 3), ["a"]) == {"a": 0}
    assert_consistent(t)


def test_bound_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BoundedPrefixTrie(0)
    assert BoundedPrefixTrie(10).stats() == {"nodes": 0, "max_nodes": 10, "evictions": 0}
