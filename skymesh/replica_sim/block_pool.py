"""The engine's KV-cache blocks: who holds each block, which full blocks are cached under
which prefix hash, LRU eviction of idle cached blocks, and the KV events (vLLM 0.32's) that
every change of the prefix cache records. Kept apart from the scheduler, which only asks
for blocks and hands them back, as vLLM v1 keeps its ``BlockPool``."""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence

import numpy as np
import xxhash

from skymesh.replica_sim import block_lru
from skymesh.replica_sim.block_lru import BlockLru
from skymesh.replica_sim.kv_events import AllBlocksCleared, StandInEvent, removed, stored
from skymesh.replica_sim.request_state import EngineRequest


def chained_block_hashes(tokens: Sequence[str], block_size: int, parent: int = 0) -> list[int]:
    """vLLM-style prefix-caching keys: one hash per FULL block, each seeded with the hash
    of the previous block, so equal hashes mean equal whole prefixes, not just equal blocks.
    A trailing partial block gets no hash (vLLM never caches it)."""
    out: list[int] = []
    h = parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        # \x1f cannot occur inside a whitespace-split token, so the join is unambiguous
        h = xxhash.xxh64_intdigest("\x1f".join(tokens[start : start + block_size]).encode(), seed=h)
        out.append(h)
    return out


@functools.cache
def block_ids(num_blocks: int) -> tuple[int, ...]:
    """``tuple(range(num_blocks))``, one per pool size: every pool's prefix cache maps a
    hash to these int objects instead of to an int of its own (28 bytes a cached block;
    a simulation of a thousand engines caches millions of blocks)."""
    return tuple(range(num_blocks))


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` tokens. A block is free (no hash, no
    reference), held (referenced by requests, maybe cached), or idle-cached (cached, no
    reference: reusable by a prefix hit, evictable in LRU order).

    KV events (off unless :meth:`enable_kv_events`) are recorded as vLLM records them: a
    block newly cached -> ``BlockStored`` (one event per request and step for its run of new
    blocks, with their token ids and the parent's hash), a cached block evicted ->
    ``BlockRemoved``, the cache emptied -> ``AllBlocksCleared``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # per block: reference count, whether it holds a prefix hash (then it is that
        # hash's one cached block: ``_cached[_hash[b]] == b``) and the hash (meaningful
        # only while held); the tables are flat arrays (an engine of thousands of blocks,
        # a simulation of a thousand engines: no int object per block)
        self._ref = array("i", [0]) * num_blocks
        self._owned = bytearray(num_blocks)
        self._hash = array("Q", [0]) * num_blocks
        self._views()
        # no hash, ref 0; a stack: which free block is used first does not matter
        self._free = array("i", range(num_blocks - 1, -1, -1))
        self._evictable = BlockLru(num_blocks)  # cached, ref 0, LRU order
        self._cached: dict[int, int] = {}  # block hash -> block id (one of _ids)
        self._ids = block_ids(num_blocks)
        self.used = 0  # blocks with ref > 0
        self.evictions = 0
        # vLLM's KV cache events since the last take_kv_events (None: not recorded)
        self.kv_events: list[StandInEvent] | None = None

    def _views(self) -> None:
        """numpy views of the per-block tables, for the calls moving many blocks at once
        (:data:`~skymesh.replica_sim.block_lru.BULK` or more: a request's prompt)."""
        n = self.num_blocks
        self._ref_np = np.frombuffer(self._ref, dtype=np.int32) if n else np.zeros(0, np.int32)
        self._owned_np = np.frombuffer(self._owned, dtype=np.bool_) if n else np.zeros(0, np.bool_)
        self._hash_np = np.frombuffer(self._hash, dtype=np.uint64) if n else np.zeros(0, np.uint64)

    # ------------------------------------------------------------------ KV events

    def enable_kv_events(self) -> None:
        """Record KV cache events from now on (requests then need ``token_ids``)."""
        if self.kv_events is None:
            self.kv_events = []

    def take_kv_events(self) -> list[StandInEvent]:
        """The events recorded since the last call, oldest first."""
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    def emit_stored(self, r: EngineRequest, first: int, end: int) -> None:
        """BlockStored for ``r``'s blocks ``first`` .. ``end - 1``, newly cached; the
        parent is the hash of the block before them (None for a prompt's first block)."""
        if self.kv_events is None or r.token_ids is None or end <= first:
            return
        bs = self.block_size
        self.kv_events.append(stored(r.block_hashes[first:end], r.block_hashes[first - 1] if first else None,
                                     r.token_ids[first * bs : end * bs], bs))

    # ------------------------------------------------------------------ state

    @property
    def num_free(self) -> int:
        """Blocks a request could get now: free ones and idle cached ones (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, only while no request holds a block (False
        otherwise, nothing changed)."""
        if self.used:
            return False
        for b in self._evictable:
            self._owned[b] = 0
            self._free.append(b)
        self._evictable.clear()
        self._cached.clear()
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return True

    def clear(self) -> None:
        """Every block free and uncached, whatever state the structures were left in: only
        builds fresh ones, so it cannot fail (the eviction counter is kept)."""
        self._ref = array("i", [0]) * self.num_blocks
        self._owned = bytearray(self.num_blocks)
        self._hash = array("Q", [0]) * self.num_blocks
        self._views()
        self._free = array("i", range(self.num_blocks - 1, -1, -1))
        self._evictable = BlockLru(self.num_blocks)
        self._cached = {}
        self.used = 0
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())

    # ------------------------------------------------------------------ allocation

    def alloc(self) -> int | None:
        """One block for a request: a free one, else the least recently used idle cached
        one (evicted); None when every block is held."""
        if not self.num_free:
            return None
        got: list[int] = []
        self.alloc_many(1, got)
        return got[0]

    def alloc_many(self, n: int, into: list[int]) -> None:
        """Append ``n`` blocks to ``into``; the caller has checked there are enough. Free
        ones first, taken with one slice off the top of the stack (long prompts need
        hundreds of blocks), then the least recently used idle cached ones, evicted
        together in the order :meth:`alloc` would evict them one by one."""
        free = self._free
        take = min(n, len(free))
        if take:
            got = free[len(free) - take :]
            del free[len(free) - take :]
            if take >= block_lru.BULK:
                self._ref_np[np.frombuffer(got, dtype=np.int32)] = 1
            else:
                ref = self._ref
                for b in got:
                    ref[b] = 1
            self.used += take
            into += got
        if n > take:
            evicted = self._evictable.pop_oldest_many(n - take)
            # every idle cached block holds its hash, as that hash's cached block: each
            # evicted one's hash leaves the cache
            cached, events = self._cached, self.kv_events
            if len(evicted) >= block_lru.BULK:
                idx = np.asarray(evicted, dtype=np.int32)
                gone = self._hash_np[idx].tolist()
                self._owned_np[idx] = False
                self._ref_np[idx] = 1
            else:
                hashes, owned, ref = self._hash, self._owned, self._ref
                gone = [hashes[b] for b in evicted]
                for b in evicted:
                    owned[b] = 0
                    ref[b] = 1
            for h in gone:
                del cached[h]
            if events is not None:
                events.extend(removed(h) for h in gone)
            self.evictions += len(evicted)
            self.used += len(evicted)
            into += evicted

    def release(self, blocks: list[int]) -> None:
        """Drop one reference on each of ``blocks`` (no repeats); a block left
        unreferenced stays cached (idle, evictable) if it holds a hash, else becomes free."""
        # reversed: a request's last blocks are the least likely to be shared, so they
        # are put first in LRU order and evicted before its prefix (vLLM does the same);
        # the idle cached ones and the freed ones each keep that order in their own list
        if len(blocks) >= block_lru.BULK:
            idx = np.asarray(blocks[::-1], dtype=np.int32)
            ref = self._ref_np
            ref[idx] -= 1
            unheld = idx[ref[idx] == 0]
            owned = self._owned_np[unheld]
            self.used -= len(unheld)
            idle = unheld[owned]
            if len(idle):
                self._evictable.extend(idle)  # stays cached until evicted (LRU)
            if len(idle) < len(unheld):
                self._free.extend(unheld[~owned].tolist())
            return
        ref, owned_b = self._ref, self._owned
        idle_b: list[int] = []
        freed: list[int] = []
        for b in reversed(blocks):
            left = ref[b] - 1
            ref[b] = left
            if left == 0:
                if owned_b[b]:
                    idle_b.append(b)
                else:
                    freed.append(b)
        self.used -= len(idle_b) + len(freed)
        if idle_b:
            self._evictable.extend(idle_b)
        if freed:
            self._free.extend(freed)

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, block_hashes: list[int], max_hit_blocks: int) -> list[int]:
        """Blocks of the longest cached prefix of ``block_hashes``, at most
        ``max_hit_blocks`` (full blocks only)."""
        cached = self._cached
        if max_hit_blocks <= 0 or block_hashes[0] not in cached:
            return []  # most misses miss at once: no need to look further
        found = list(map(cached.get, block_hashes[:max_hit_blocks]))
        try:
            return found[: found.index(None)]
        except ValueError:
            return found  # type: ignore[return-value]

    def num_idle(self, blocks: list[int]) -> int:
        """How many of ``blocks`` no request holds (counted in :attr:`num_free`)."""
        if len(blocks) >= block_lru.BULK:
            return int(np.count_nonzero(self._ref_np[np.asarray(blocks, dtype=np.int32)] == 0))
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    def share(self, blocks: list[int]) -> None:
        """Take a reference on each of ``blocks`` (prefix hits, no repeats), pulling idle
        ones out of the LRU order."""
        if len(blocks) >= block_lru.BULK:
            idx = np.asarray(blocks, dtype=np.int32)
            ref = self._ref_np
            idle = idx[ref[idx] == 0]
            if len(idle):
                self._evictable.remove_many(idle)
                self.used += len(idle)
            ref[idx] += 1
            return
        ref_a = self._ref
        idle_b = [b for b in blocks if ref_a[b] == 0]
        if idle_b:
            self._evictable.remove_many(idle_b)
            self.used += len(idle_b)
        for b in blocks:
            ref_a[b] += 1

    def register_computed(self, r: EngineRequest, before: int) -> None:
        """Publish the hashes of the blocks that became fully computed since ``before``
        computed tokens: prompt blocks and, as vLLM caches them too (``cache_blocks`` up to
        the tokens whose KV exists), blocks of generated tokens. Each block is cached under
        its hash unless that hash is cached already (the stand-in keeps one block per
        hash), as :meth:`register_block` does; a stretch of hashes none of which is cached
        (a prompt's uncached part, as a rule) is cached at once."""
        bs = self.block_size
        first = before // bs
        end = min(r.num_computed // bs, len(r.block_hashes), len(r.blocks))
        if end <= first:
            return
        block_hashes, blocks, cached, hashes = r.block_hashes, r.blocks, self._cached, self._hash
        if end - first >= block_lru.BULK:
            new_hashes = block_hashes[first:end]
            # none cached, no repeat (each check runs over the new hashes alone)
            if not any(map(cached.__contains__, new_hashes)) and len(set(new_hashes)) == len(new_hashes):
                new_blocks = blocks[first:end]
                cached.update(zip(new_hashes, map(self._ids.__getitem__, new_blocks), strict=True))
                idx = np.asarray(new_blocks, dtype=np.int32)
                self._hash_np[idx] = np.asarray(new_hashes, dtype=np.uint64)
                self._owned_np[idx] = True
                self.emit_stored(r, first, end)
                return
        owned, ids = self._owned, self._ids
        run = -1  # first block of the current run of newly cached blocks (KV events)
        for i in range(first, end):
            h = block_hashes[i]
            if h not in cached:
                b = blocks[i]
                hashes[b] = h
                owned[b] = 1
                cached[h] = ids[b]
                if run < 0:
                    run = i
            elif run >= 0:
                self.emit_stored(r, run, i)
                run = -1
        if run >= 0:
            self.emit_stored(r, run, end)

    def register_block(self, r: EngineRequest, i: int) -> bool:
        """Cache block ``i`` of ``r`` under its hash; False when that hash is already
        cached (the stand-in keeps one block per hash)."""
        h = r.block_hashes[i]
        if h in self._cached:
            return False
        b = r.blocks[i]
        self._hash[b] = h
        self._owned[b] = 1
        self._cached[h] = self._ids[b]
        return True
