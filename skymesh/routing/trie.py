"""Bounded prefix trie over cumulative chunk hashes.

A cumulative chunk hash already identifies the whole prefix it ends (see ``hashing``), so
the trie is stored flat: node id = cumulative hash, with a parent link and a child count.
Walking a prompt is then one dict lookup per chunk, O(n) — a path-keyed trie (pygtrie)
re-walks the path from the root at each level, O(n^2), which broke the decision-time
budget at 2k-token prompts.

Each node records the targets (replicas, or peer regions for a snapshot trie) that were
sent that prefix and when. A hard bound on the node count is enforced by evicting the least
recently used *leaves* first (SkyWalker evicts oldest entries); interior nodes are never
orphaned, so memory stays bounded under an endless stream of unique prompts. Leaves are kept in their
own LRU list so an eviction is O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any


def _narrow(alive: set[str] | frozenset[str], targets: dict[str, float]) -> set[str]:
    """alive ∩ targets in O(min(len)) — deep nodes hold one or two targets."""
    if len(targets) < len(alive):
        return {t for t in targets if t in alive}
    return {t for t in alive if t in targets}


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
        self._nodes: dict[int, _Node] = {}
        # the current leaves in least-recently-used order: eviction pops the front, O(1)
        self._leaves: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def insert(self, chunks: Sequence[int], target: str, now: float) -> None:
        nodes = self._nodes
        leaves = self._leaves
        parent: int | None = None
        # a path longer than the whole bound keeps only its first max_nodes chunks
        for h in chunks[: self.max_nodes]:
            node = nodes.get(h)
            if node is None:
                node = nodes[h] = _Node(parent)
                if parent is not None:
                    pn = nodes[parent]
                    if pn.children == 0:
                        leaves.pop(parent, None)
                    pn.children += 1
                leaves[h] = None
            elif node.children == 0:
                leaves.move_to_end(h)
            node.targets[target] = now
            parent = h
        if len(nodes) > self.max_nodes:
            self._evict(protect=parent)

    def _evict(self, protect: int | None) -> None:
        nodes = self._nodes
        leaves = self._leaves
        while len(nodes) > self.max_nodes and leaves:
            victim = next(iter(leaves))
            if victim == protect:
                if len(leaves) == 1:
                    return
                leaves.move_to_end(victim)
                continue
            del leaves[victim]
            node = nodes.pop(victim)
            if node.parent is not None:
                p = nodes.get(node.parent)
                if p is not None:
                    p.children -= 1
                    if p.children == 0:
                        # as old as the child it just lost: first in line
                        leaves[node.parent] = None
                        leaves.move_to_end(node.parent, last=False)
            self.evictions += 1

    def longest_match(
        self, chunks: Sequence[int], available_targets: Iterable[str]
    ) -> tuple[int, set[str]]:
        """Longest prefix (in chunks) held by any of ``available_targets``, and which of
        them hold it.

        A target on a node also holds every ancestor (paths are inserted whole and only
        leaves are evicted), so: walk down while the path exists (one dict lookup per
        chunk, stopping where it leaves the trie), then scan back up only until the first
        node an available target holds. Deep nodes hold one or two targets, so the common
        case never touches the wide, shared system-prompt nodes at all.
        """
        alive = available_targets if isinstance(available_targets, (set, frozenset)) else set(available_targets)
        if not alive:
            return 0, set()
        nodes = self._nodes
        path: list[_Node] = []
        for h in chunks:
            node = nodes.get(h)
            if node is None:
                break
            path.append(node)
        for depth in range(len(path), 0, -1):
            owners = _narrow(alive, path[depth - 1].targets)
            if owners:
                return depth, owners
        return 0, set()

    def match_per_target(self, chunks: Sequence[int], targets: Iterable[str]) -> dict[str, int]:
        """Matched chunk count for each target (0 when it holds no prefix)."""
        remaining = set(targets)
        out = dict.fromkeys(remaining, 0)
        nodes = self._nodes
        depth = 0
        for h in chunks:
            node = nodes.get(h)
            if node is None:
                break
            kept = _narrow(remaining, node.targets)
            # targets dropping out here matched exactly `depth` chunks (O(dropped) work)
            if len(kept) != len(remaining):
                for t in remaining - kept:
                    out[t] = depth
            remaining = kept
            if not remaining:
                break
            depth += 1
        for t in remaining:
            out[t] = depth
        return out

    def remove_target(self, target: str) -> None:
        for node in self._nodes.values():
            node.targets.pop(target, None)

    def stats(self) -> dict[str, Any]:
        return {"nodes": len(self._nodes), "max_nodes": self.max_nodes, "evictions": self.evictions}
