"""Bounded prefix trie: the hard bound, LRU-leaf eviction, longest match, early stop."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.trie import WIDE_NODE, BoundedPrefixTrie


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
        t.insert(system + suffix, f"r{i % 8}")
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
    for op, path, target in ops:
        if op == "insert":
            # cumulative ids: a node id names its whole prefix, like chunk_hashes does
            chunks = tuple(hash(tuple(path[: i + 1])) for i in range(len(path)))
            t.insert(chunks, target)
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
        t.insert(ids(path), target)

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
    t.insert((1, 2, 3, 4, 5, 6), "busy")
    t.insert((1, 2), "free")
    t.insert((1, 2, 3), "other")
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
    t.insert((1, 10), "a")
    t.insert((1, 20), "b")
    t.insert((1, 10), "a")  # refreshes leaf 10: leaf 20 is now the oldest
    t.insert((1, 30), "c")  # fits (4 nodes)
    t.insert((1, 40), "d")  # one over: evicts 20
    assert 20 not in t and all(h in t for h in (1, 10, 30, 40))
    assert t.targets_at(1) == ("a", "b", "c", "d")  # in the order they first came


def test_interior_nodes_go_only_after_their_children() -> None:
    t = BoundedPrefixTrie(3)
    t.insert((1, 2, 3), "a")
    t.insert((7,), "b")  # evicts leaf 3; 2 becomes a leaf and is oldest
    assert 3 not in t and 2 in t and 7 in t
    t.insert((8,), "b")  # evicts 2 (then 1 would be next), never an orphan
    assert 2 not in t and 1 in t and len(t) == 3
    assert_consistent(t)


def test_a_path_longer_than_the_bound_keeps_its_head() -> None:
    t = BoundedPrefixTrie(5)
    t.insert(tuple(range(1, 21)), "a")
    assert len(t) == 5 and t.longest_match(tuple(range(1, 21)), {"a"}) == (5, {"a"})


def test_remove_target_forgets_a_replica_everywhere() -> None:
    t = BoundedPrefixTrie(100)
    t.insert((1, 2, 3), "a")
    t.insert((1, 2), "b")
    t.remove_target("a")
    assert t.longest_match((1, 2, 3), {"a", "b"}) == (2, {"b"})
    assert t.match_per_target((1, 2, 3), ["a"]) == {"a": 0}
    assert_consistent(t)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert"] * 5 + ["remove"]),
            st.lists(st.integers(0, 1), min_size=1, max_size=4),
            st.integers(0, 2 * WIDE_NODE),
        ),
        max_size=80,
    ),
)
def test_node_targets_keep_their_first_order_across_the_wide_form(ops: list[tuple[str, list[int], int]]) -> None:
    # a node's targets are a tuple below WIDE_NODE and a dict from it on: either way what
    # it holds, and in what order, is a list of first arrivals less the removed targets
    t = BoundedPrefixTrie(10_000)
    model: dict[int, list[str]] = {}
    for op, path, n in ops:
        target = f"r{n}"
        if op == "insert":
            chunks = tuple(hash(("w", *path[: i + 1])) for i in range(len(path)))
            t.insert(chunks, target)
            for h in chunks:
                held = model.setdefault(h, [])
                if target not in held:
                    held.append(target)
        else:
            t.remove_target(target)
            for held in model.values():
                if target in held:
                    held.remove(target)
        assert {h: list(t.targets_at(h)) for h in model} == model
        assert all(isinstance(t._targets[h], dict) for h, held in model.items() if len(held) >= WIDE_NODE)
    assert_consistent(t)


def test_bound_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BoundedPrefixTrie(0)
    assert BoundedPrefixTrie(10).stats() == {"nodes": 0, "max_nodes": 10, "evictions": 0}
