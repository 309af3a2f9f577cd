"""The replicas' exact cache state, from vLLM's KV events.

A replica that publishes KV events (vLLM's ``--kv-events-config``) says which blocks it
stored (token ids, block size, its own block hash, the parent's hash) and which it
evicted. :class:`ReplicaBlockIndex` keeps, per replica, the set of blocks it holds keyed
by skymesh's own cumulative hash of each block's token ids: the same function as the
balancer's prompt chunk hashes (same bytes, same seeds: :func:`skymesh.routing.hashing.block_hash`
and :func:`~skymesh.routing.hashing.id_chunk_hashes`, side by side), so a
prompt's cached prefix is a lookup of its chunk hashes, with no dependency on vLLM's hash
algorithm or ``PYTHONHASHSEED``. vLLM's own hashes are kept only to resolve parents and
removals. This needs the balancer's chunks to be the replica's blocks
(``policy.chunk_tokens`` == block size) and token ids on the balancer's side (a
configured tokenizer); otherwise the index says so and is not used.

A cache-aware policy reads it through :class:`~skymesh.routing.cache_view.CacheView`
(skymesh/routing/cache_sources/kv_events.py is its cache source): per replica, the event
index while it is live (events flowing, in step), else the routing history.

Pure: no sockets, no clock (``now`` is passed in).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from skymesh.routing.hashing import block_hash

# a vLLM block hash: bytes (sha256 digests) or an int, depending on the version
BlockHash = Hashable


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class ReplicaBlockIndex:
    """The blocks one replica holds, from its events. Bounded: at most ``max_blocks``
    (the replica's KV capacity in blocks when known); past that the least recently stored
    go first, which only happens when removals were missed."""

    def __init__(self, chunk_tokens: int, max_blocks: int) -> None:
        self.chunk_tokens = chunk_tokens
        self.max_blocks = max_blocks
        # vLLM block hash -> skymesh block hash, in store order (the LRU bound)
        self._ours: OrderedDict[BlockHash, int] = OrderedDict()
        # skymesh block hash -> how many vLLM blocks have it (a block stored twice, e.g.
        # under two KV cache groups, is cached until both are removed)
        self._held: dict[int, int] = {}
        self.block_size: int | None = None
        self.stored_total = 0
        self.removed_total = 0
        self.orphans = 0  # stored blocks whose parent was never seen (a missed event)
        self.evicted_by_bound = 0
        self.last_event_at: float | None = None
        # set once events flow (the region core's kv_events); until then the trie answers
        self.in_step = False

    def __len__(self) -> int:
        return len(self._ours)

    @property
    def usable(self) -> bool:
        """Its chunks are the balancer's (else lookups would never match)."""
        return self.block_size is None or self.block_size == self.chunk_tokens

    def apply(self, events: Iterable[KvEvent], now: float) -> list[int]:
        """Apply a batch; returns the blocks (the balancer's chunk hashes) newly stored."""
        stored: list[int] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(ev, stored)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._drop(h)
                    self.removed_total += 1
            else:
                self.clear()
        self.last_event_at = now
        return stored

    def _stored(self, ev: BlockStored, stored: list[int]) -> None:
        self.block_size = ev.block_size
        size = ev.block_size
        if ev.parent_block_hash is None:
            parent = 0
        elif ev.parent_block_hash in self._ours:
            parent = self._ours[ev.parent_block_hash]
        else:
            self.orphans += 1  # its prefix is unknown here: these blocks cannot be keyed
            return
        for k, vllm_hash in enumerate(ev.block_hashes):
            ids = ev.token_ids[k * size : (k + 1) * size]
            if len(ids) < size:
                break  # vLLM stores full blocks only
            ours = block_hash(ids, parent)
            if vllm_hash in self._ours:
                self._ours.move_to_end(vllm_hash)
            else:
                self._ours[vllm_hash] = ours
                self._held[ours] = self._held.get(ours, 0) + 1
                self.stored_total += 1
                stored.append(ours)
            parent = ours
        while len(self._ours) > self.max_blocks:
            old, ours = self._ours.popitem(last=False)
            self._release(ours)
            self.evicted_by_bound += 1

    def _drop(self, vllm_hash: BlockHash) -> None:
        ours = self._ours.pop(vllm_hash, None)
        if ours is not None:
            self._release(ours)

    def _release(self, ours: int) -> None:
        n = self._held.get(ours, 0) - 1
        if n > 0:
            self._held[ours] = n
        else:
            self._held.pop(ours, None)

    def clear(self) -> None:
        self._ours.clear()
        self._held.clear()

    def cached_chunks(self, chunk_hashes: Sequence[int]) -> int:
        """How many leading chunks of a prompt this replica holds."""
        n = 0
        held = self._held
        for h in chunk_hashes:
            if h not in held:
                break
            n += 1
        return n

    def stats(self) -> dict[str, Any]:
        return {"blocks": len(self._ours), "max_blocks": self.max_blocks, "block_size": self.block_size,
                "stored_total": self.stored_total, "removed_total": self.removed_total,
                "orphans": self.orphans, "evicted_by_bound": self.evicted_by_bound,
                "in_step": self.in_step, "usable": self.usable}


@dataclass
class KvIndexes:
    """The event indexes of a region's replicas (only those that publish events)."""

    chunk_tokens: int = 64
    default_max_blocks: int = 1 << 20
    by_replica: dict[str, ReplicaBlockIndex] = field(default_factory=dict)

    def index(self, replica_id: str, max_blocks: int | None = None) -> ReplicaBlockIndex:
        idx = self.by_replica.get(replica_id)
        if idx is None:
            idx = self.by_replica[replica_id] = ReplicaBlockIndex(self.chunk_tokens,
                                                                  max_blocks or self.default_max_blocks)
        elif max_blocks is not None:
            idx.max_blocks = max_blocks
        return idx

    def live(self, replica_id: str) -> ReplicaBlockIndex | None:
        """The replica's index if it can answer now: events flow and its blocks are our chunks."""
        idx = self.by_replica.get(replica_id)
        if idx is None or not idx.in_step or not idx.usable:
            return None
        return idx

    def forget(self, replica_id: str) -> None:
        self.by_replica.pop(replica_id, None)

    def source_of(self, replica_id: str) -> str:
        """What answers for this replica: "events" or "routing-history" (status)."""
        return "events" if self.live(replica_id) is not None else "routing-history"
