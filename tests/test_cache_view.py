"""The region's CacheView asks its cache sources in order: each replica is answered by the
first source live for it, the routing history last; writes go to the routing history."""

from __future__ import annotations

from collections.abc import Sequence

from skymesh.routing.cache_sources.base import CacheSource
from skymesh.routing.cache_sources.kv_events import KvEventSource
from skymesh.routing.cache_sources.routing_history import RoutingHistory
from skymesh.routing.cache_view import CacheView
from skymesh.routing.kv_index import KvIndexes
from skymesh.routing.model import RegionModel, cache_sources
from skymesh.routing.trie import BoundedPrefixTrie

CHUNKS = (11, 12, 13, 14)


class ToySource:
    """Says every replica it knows holds ``chunks`` leading chunks; remembers who asked."""

    def __init__(self, name: str, knows: set[str], chunks: int) -> None:
        self.name = name
        self.knows = knows
        self.chunks = chunks
        self.asked: list[list[str]] = []

    def any_live(self) -> bool:
        return bool(self.knows)

    def live(self, replica_id: str) -> bool:
        return replica_id in self.knows

    def match_per_target(self, chunks: Sequence[int], replica_ids: Sequence[str]) -> dict[str, int]:
        self.asked.append(list(replica_ids))
        return {r: self.chunks for r in replica_ids if r in self.knows}


def history_with(*held: tuple[str, int]) -> RoutingHistory:
    history = RoutingHistory(BoundedPrefixTrie(1000))
    for replica, n in held:
        history.record(CHUNKS[:n], replica)
    return history


def test_a_toy_source_added_to_the_list_is_consulted_in_order() -> None:
    history = history_with(("r1", 1), ("r2", 1), ("r3", 2))
    first = ToySource("first", {"r1"}, 4)
    second = ToySource("second", {"r1", "r2"}, 3)
    sources: list[CacheSource] = [first, second, history]
    view = CacheView(sources, history)
    assert view.match_per_target(CHUNKS, ["r1", "r2", "r3"]) == {"r1": 4, "r2": 3, "r3": 2}
    # each replica was asked of the first source live for it only
    assert first.asked == [["r1"]] and second.asked == [["r2"]]
    assert view.source_names(["r1", "r2", "r3"]) == {"r1": "first", "r2": "second", "r3": "routing-history"}
    assert view.longest_match(CHUNKS, ["r1", "r2", "r3"]) == (4, {"r1"})
    # the other order: the second source now answers for r1 too
    swapped = CacheView([second, first, history], history)
    assert swapped.match_per_target(CHUNKS, ["r1", "r2", "r3"]) == {"r1": 3, "r2": 3, "r3": 2}
    assert swapped.longest_match(CHUNKS, ["r1", "r2", "r3"]) == (3, {"r1", "r2"})


def test_a_source_live_for_no_replica_leaves_every_answer_to_the_routing_history() -> None:
    history = history_with(("r1", 3))
    idle = ToySource("idle", set(), 4)
    view = CacheView([idle, history], history)
    assert view.match_per_target(CHUNKS, ["r1", "r2"]) == {"r1": 3, "r2": 0}
    assert view.longest_match(CHUNKS, ["r1", "r2"]) == (3, {"r1"})
    assert idle.asked == []


def test_writes_go_to_the_routing_history() -> None:
    history = history_with()
    toy = ToySource("toy", {"r1"}, 1)
    view = CacheView([toy, history], history)
    view.insert(CHUNKS, "r1")
    view.insert(CHUNKS[:2], "r2")
    assert view.match_per_target(CHUNKS, ["r1", "r2"]) == {"r1": 1, "r2": 2}  # r1: the toy answers
    assert history.match_per_target(CHUNKS, ["r1"]) == {"r1": 4}
    view.remove_target("r2")
    assert view.match_per_target(CHUNKS, ["r2"]) == {"r2": 0}


def test_the_region_model_asks_kv_events_before_the_routing_history() -> None:
    indexes = KvIndexes(chunk_tokens=16)
    model = RegionModel(chunk_tokens=16, kv_indexes=indexes)
    kinds = [type(s) for s in model.cache.sources]
    assert kinds == [KvEventSource, RoutingHistory] and model.cache.sources[-1] is model.cache.history
    history = RoutingHistory(BoundedPrefixTrie(10))
    assert cache_sources(history, None) == [history]
