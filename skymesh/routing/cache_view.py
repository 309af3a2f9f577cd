"""The one question policies and queue disciplines ask of a replica's cache: how much of
this prompt does it hold? :class:`CacheView` answers from an ordered list of
:class:`~skymesh.routing.cache_sources.base.CacheSource`: each replica by the first source
live for it (the replica's KV events while they flow, else the routing history). It speaks
the trie's query API, so a reader does not know which source answered. Writes (a
dispatch, a replica leaving) go to the routing history, which stays ready as the fallback.

Pure: no sockets, no clock (``now`` is passed in).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from skymesh.routing.cache_sources.base import CacheSource
from skymesh.routing.cache_sources.routing_history import RoutingHistory


class CacheView:
    """Reads ``sources`` in order (each replica from the first one live for it; a replica
    none is live for holds nothing); writes go to ``history``, which is one of them."""

    def __init__(self, sources: Sequence[CacheSource], history: RoutingHistory) -> None:
        self.sources = list(sources)
        self.history = history

    # writes: the routing history
    def insert(self, chunks: Sequence[int], target: str) -> None:
        self.history.record(chunks, target)

    def remove_target(self, target: str) -> None:
        self.history.forget(target)

    # reads
    def _only_history(self) -> bool:
        """Whether the routing history answers for every replica (no source before it is
        live for any): the trie's own queries then answer whole."""
        for source in self.sources:
            if source is self.history:
                return True
            if source.any_live():
                return False
        return False

    def match_per_target(self, chunks: Sequence[int], targets: Iterable[str]) -> dict[str, int]:
        left = list(targets)
        if self._only_history():
            return self.history.match_per_target(chunks, left)
        out: dict[str, int] = {}
        for source in self.sources:
            if not left:
                break
            if not source.any_live():
                continue
            mine = [t for t in left if source.live(t)]
            if mine:
                out.update(source.match_per_target(chunks, mine))
                answered = set(mine)
                left = [t for t in left if t not in answered]
        out.update((t, 0) for t in left)
        return out

    def longest_match(self, chunks: Sequence[int], available_targets: Iterable[str]) -> tuple[int, set[str]]:
        if self._only_history():
            return self.history.longest_match(chunks, available_targets)
        per = self.match_per_target(chunks, available_targets)
        best = max(per.values(), default=0)
        if best <= 0:
            return 0, set()
        return best, {t for t, n in per.items() if n == best}

    def source_for(self, replica_id: str) -> CacheSource | None:
        """The source that answers for ``replica_id`` now (None: no source is live for it)."""
        return next((s for s in self.sources if s.live(replica_id)), None)

    def answered_by_history(self, replica_id: str) -> bool:
        return self.source_for(replica_id) is self.history

    def stats(self) -> dict[str, Any]:
        return self.history.stats()

    def source_names(self, replica_ids: Iterable[str]) -> Mapping[str, str]:
        """What answers for each replica, by the source's name (status)."""
        out: dict[str, str] = {}
        for rid in replica_ids:
            source = self.source_for(rid)
            out[rid] = source.name if source is not None else "none"
        return out
