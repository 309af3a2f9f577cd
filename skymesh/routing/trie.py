"""Bounded prefix trie over cumulative chunk hashes.

A cumulative chunk hash already identifies the whole prefix it ends (see ``hashing``), so
the trie is stored flat: node id = cumulative hash, with a parent link and a child count.
Walking a prompt is then one dict lookup per chunk, O(n) — a path-keyed trie (pygtrie)
re-walks the path from the root at each level, O(n^2), which broke the decision-time
budget at 2k-token prompts.

Each node records the targets (replicas, or peer regions for a snapshot trie) that were
sent that prefix, in the order they first were (no times: the lookups ask only who holds
a prefix, and eviction goes by the leaves' LRU order). A hard bound on the node count is enforced by
evicting the least recently used *leaves* first (SkyWalker evicts oldest entries); interior
nodes are never orphaned, so memory stays bounded under an endless stream of unique
prompts. Leaves are kept in their own LRU list so an eviction is O(1).

Invariant the lookups rely on: a target recorded on a node is recorded on every ancestor
(paths are inserted whole, only leaves are evicted, ``remove_target`` clears every node).

Storage is three flat dicts keyed by node id instead of one object per node: a node then
costs no garbage-collector-tracked allocation (a tuple or dict of strings is untracked), so
a stream of inserts never triggers cyclic-GC passes over the trie, and creating a node is
cheaper than instantiating a class. A node's targets are a tuple while they are few (most
nodes: one or two replicas; 48-64 bytes where a dict took 184, a quarter of a node) and a
dict of target -> None from ``WIDE_NODE`` on (a shared system prompt's nodes, held by
every replica: membership stays O(1)); both keep the order targets arrived in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

# from this many targets a node keeps them in a dict (O(1) membership), below in a tuple
WIDE_NODE = 8

Targets = tuple[str, ...] | dict[str, None]


class BoundedPrefixTrie:
    def __init__(self, max_nodes: int) -> None:
        if max_nodes < 1:
            raise ValueError("max_nodes must be >= 1")
        self.max_nodes = max_nodes
        # node id -> the targets sent this prefix (Targets); a key exists iff the node does
        self._targets: dict[int, Targets] = {}
        self._parent: dict[int, int | None] = {}  # None for first-chunk nodes
        self._children: dict[int, int] = {}  # child count; absent for leaves
        # the current leaves in least-recently-used order: eviction pops the front, O(1)
        self._leaves: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._targets)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._targets

    def insert(self, chunks: Sequence[int], target: str) -> None:
        """Record that ``target`` was sent the prompt whose chunk hashes are ``chunks``."""
        nodes = self._targets
        children = self._children
        # a path longer than the whole bound keeps only its first max_nodes chunks
        path = chunks if len(chunks) <= self.max_nodes else chunks[: self.max_nodes]
        parent: int | None = None
        depth = 0
        # the part of the prompt already in the trie: add the target where it is missing
        for h in path:
            held = nodes.get(h)
            if held is None:
                break
            if target not in held:
                if type(held) is dict:
                    held[target] = None
                elif len(held) + 1 < WIDE_NODE:
                    nodes[h] = (*held, target)
                else:
                    nodes[h] = dict.fromkeys((*held, target))
            parent = h
            depth += 1
        leaves = self._leaves
        if depth == len(path):
            if parent is not None and parent not in children:
                leaves.move_to_end(parent)
            return
        # the new tail: a chain where every node but the last has exactly one child.
        # (A node present in the trie cannot follow a missing one: its id is the whole
        # prefix, so its parent would be present too.)
        tail = path[depth:]
        if parent is not None:
            count = children.get(parent, 0)
            if count == 0:
                del leaves[parent]  # it has a child now
            children[parent] = count + 1
        nodes.update(dict.fromkeys(tail, (target,)))
        self._parent.update(zip(tail, (parent, *tail[:-1]), strict=True))
        children.update(dict.fromkeys(tail[:-1], 1))
        last = tail[-1]
        leaves[last] = None
        if len(nodes) > self.max_nodes:
            self._evict(protect=last)

    def _evict(self, protect: int) -> None:
        nodes = self._targets
        children = self._children
        parents = self._parent
        leaves = self._leaves
        limit = self.max_nodes
        while len(nodes) > limit and leaves:
            victim, _ = leaves.popitem(last=False)
            if victim == protect:  # never drop the prompt just inserted
                leaves[victim] = None
                if len(leaves) == 1:
                    return
                continue
            while True:
                del nodes[victim]
                self.evictions += 1
                parent = parents.pop(victim)
                if parent is None:
                    break
                count = children[parent] - 1
                if count:
                    children[parent] = count
                    break
                del children[parent]
                if len(nodes) > limit:
                    # it just became the oldest leaf: it is next in line anyway
                    victim = parent
                    continue
                # as old as the child it just lost: first in line
                leaves[parent] = None
                leaves.move_to_end(parent, last=False)
                break

    def _path(self, chunks: Sequence[int]) -> list[Targets]:
        """The target sets of the prompt's nodes present in the trie, root first."""
        nodes = self._targets
        path: list[Targets] = []
        for h in chunks:
            held = nodes.get(h)
            if held is None:
                break
            path.append(held)
        return path

    def longest_match(
        self, chunks: Sequence[int], available_targets: Iterable[str]
    ) -> tuple[int, set[str]]:
        """Longest prefix (in chunks) held by any of ``available_targets``, and which of
        them hold it.

        By the ancestor invariant, the answer is the deepest node on the prompt's path that
        an available target holds: walk down while the path exists (one dict lookup per
        chunk), then scan back up and stop at the first such node. Nodes below it, held
        only by unavailable targets, are never intersected with the available set, and deep
        nodes hold one or two targets, so the common case never touches the wide, shared
        system-prompt nodes at all.
        """
        alive = (
            available_targets
            if isinstance(available_targets, (set, frozenset))
            else set(available_targets)
        )
        if not alive:
            return 0, set()
        path = self._path(chunks)
        for depth in range(len(path), 0, -1):
            held = path[depth - 1]
            if len(held) < len(alive):
                owners = {t for t in held if t in alive}
            else:
                owners = {t for t in alive if t in held}
            if owners:
                return depth, owners
        return 0, set()

    def match_per_target(self, chunks: Sequence[int], targets: Iterable[str]) -> dict[str, int]:
        """Matched chunk count for each target (0 when it holds no prefix).

        Scanned bottom-up: by the ancestor invariant, the deepest node where a target
        appears is its match. A target is settled the first time it is seen, and the scan
        stops once every target is settled, so the cost is the path length plus the sizes
        of the nodes visited, never path length x targets.
        """
        out = dict.fromkeys(targets, 0)
        left = set(out)
        path = self._path(chunks)
        for depth in range(len(path), 0, -1):
            if not left:
                break
            held = path[depth - 1]
            if len(held) < len(left):
                found = [t for t in held if t in left]
            else:
                found = [t for t in left if t in held]
            for t in found:
                out[t] = depth
            left.difference_update(found)
        return out

    def targets_at(self, node_id: int) -> tuple[str, ...]:
        """The targets sent one node's prefix, in the order they first were (() if absent)."""
        return tuple(self._targets.get(node_id, ()))

    def remove_target(self, target: str) -> None:
        """Forget ``target`` everywhere (a replica left). O(nodes): membership changes are rare."""
        nodes = self._targets
        for h, held in nodes.items():
            if target in held:
                if type(held) is dict:
                    del held[target]
                else:
                    nodes[h] = tuple(t for t in held if t != target)

    def stats(self) -> dict[str, Any]:
        return {"nodes": len(self._targets), "max_nodes": self.max_nodes, "evictions": self.evictions}
