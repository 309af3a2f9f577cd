"""What the balancer sent where: a bounded prefix trie of the prompts dispatched to each
replica. Live for every replica (the fallback that always answers); the one source a
:class:`~skymesh.routing.cache_view.CacheView` writes to."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from skymesh.routing.trie import BoundedPrefixTrie


class RoutingHistory:
    name = "routing-history"

    def __init__(self, trie: BoundedPrefixTrie) -> None:
        self.trie = trie

    def any_live(self) -> bool:
        return True

    def live(self, replica_id: str) -> bool:
        return True

    def match_per_target(self, chunks: Sequence[int], replica_ids: Sequence[str]) -> dict[str, int]:
        return self.trie.match_per_target(chunks, replica_ids)

    def longest_match(self, chunks: Sequence[int], replica_ids: Iterable[str]) -> tuple[int, set[str]]:
        return self.trie.longest_match(chunks, replica_ids)

    def record(self, chunks: Sequence[int], replica_id: str) -> None:
        """``replica_id`` was sent the prompt whose chunk hashes are ``chunks`` (recording
        it again changes only the LRU order of its leaf)."""
        self.trie.insert(chunks, replica_id)

    def forget(self, replica_id: str) -> None:
        self.trie.remove_target(replica_id)

    def stats(self) -> dict[str, Any]:
        return self.trie.stats()
