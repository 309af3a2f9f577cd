"""Bounded prefix trie over cumulative chunk hashes.

A cumulative chunk hash already identifies the whole prefix it ends (see ``hashing``), so
the trie is stored flat: node id = cumulative hash, with a parent link and a child count.
Walking a prompt is then one dict lookup per chunk, O(n) — a path-keyed trie (pygtrie)
re-walks the path from the root at each level, O(n^2), which broke the decision-time
budget at 2k-token prompts.

Each node records the targets (replicas, or peer regions for a snapshot trie) that were
sent that prefix and when. A hard bound on the node count is enforced by evicting the least
recently used *leaves* first (SkyWalker evicts oldest entries); interior nodes are never
orphaned, so memory stays bounded under an endless stream of unique prompts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any


class _Node:
    __slots__ = ("targets", "children", "parent")

    def __init__(self, parent: int | None) -> None:
        self.targets: dict[str, float] = {}  # target -> last use
        self.children = 0
        self.parent = parent


class BoundedPrefixTrie:
    def __init__(self, max_nodes: int) -> None:
        if max_nodes < 1:
            raise ValueError("max_nodes must be >= 1")
        self.max_nodes = max_nodes
        # node id -> node, in least-recently-used order (the front is evicted first)
        self._nodes: OrderedDict[int, _Node] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def insert(self, chunks: Sequence[int], target: str, now: float) -> None:
        nodes = self._nodes
        parent: int | None = None
        # a path longer than the whole bound keeps only its first max_nodes chunks
        for h in chunks[: self.max_nodes]:
            node = nodes.get(h)
            if node is None:
                node = nodes[h] = _Node(parent)
                if parent is not None:
                    nodes[parent].children += 1
            else:
                nodes.move_to_end(h)
            node.targets[target] = now
            parent = h
        if len(nodes) > self.max_nodes:
            self._evict(protect=parent)

    def _evict(self, protect: int | None) -> None:
        nodes = self._nodes
        while len(nodes) > self.max_nodes:
            victim = None
            # the least recently used leaf: a path is refreshed root to leaf on insert, so
            # a leaf is always behind its ancestors and the scan ends after a few steps
            for h, node in nodes.items():
                if node.children == 0 and h != protect:
                    victim = h
                    break
            if victim is None:
                return
            node = nodes.pop(victim)
            if node.parent is not None:
                p = nodes.get(node.parent)
                if p is not None:
                    p.children -= 1
            self.evictions += 1

    def longest_match(
        self, chunks: Sequence[int], available_targets: Iterable[str]
    ) -> tuple[int, set[str]]:
        """Longest prefix (in chunks) held by any of ``available_targets``, and which of
        them hold it. Stops as soon as no available target remains on the path."""
        alive = set(available_targets)
        best_len, best = 0, set()
        nodes = self._nodes
        for i, h in enumerate(chunks):
            node = nodes.get(h)
            if node is None:
                break
            alive &= node.targets.keys()
            if not alive:
                break
            best_len, best = i + 1, alive
        return best_len, set(best)

    def match_per_target(self, chunks: Sequence[int], targets: Iterable[str]) -> dict[str, int]:
        """Matched chunk count for each target (0 when it holds no prefix)."""
        remaining = set(targets)
        out = dict.fromkeys(remaining, 0)
        nodes = self._nodes
        for i, h in enumerate(chunks):
            node = nodes.get(h)
            if node is None:
                break
            remaining &= node.targets.keys()
            if not remaining:
                break
            for t in remaining:
                out[t] = i + 1
        return out

    def remove_target(self, target: str) -> None:
        for node in self._nodes.values():
            node.targets.pop(target, None)

    def stats(self) -> dict[str, Any]:
        return {"nodes": len(self._nodes), "max_nodes": self.max_nodes, "evictions": self.evictions}
