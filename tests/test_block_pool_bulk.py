"""The engine's block pool, which takes and gives back a request's blocks in bulk, against
a reference pool that does everything one block at a time (free stack, an OrderedDict for
the LRU order, a dict of cached hashes): after any sequence of admissions (prefix hits
shared, the rest allocated, evicting the least recently used), computed blocks cached,
and requests finishing, both give the same blocks, cache the same hashes, evict the same
blocks in the same order and record the same KV events."""

from __future__ import annotations

import random
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.replica_sim import block_lru
from skymesh.replica_sim.block_pool import BlockPool
from skymesh.replica_sim.kv_events import removed, stored
from skymesh.replica_sim.request_state import EngineRequest


class ReferencePool:
    """The block pool's rules, one block at a time."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[int, int] = {}
        self.used = self.evictions = 0
        self.events: list[object] = []

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.lru)

    def lookup(self, hashes: list[int], most: int) -> list[int]:
        out = []
        for h in hashes[:most]:
            if h not in self.cached:
                break
            out.append(self.cached[h])
        return out

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.lru[b]
                self.used += 1
            self.ref[b] += 1

    def alloc_many(self, n: int) -> list[int]:
        """The free blocks at the top of the stack as they lie (one slice), then one
        block at a time."""
        take = min(n, len(self.free))
        got = self.free[len(self.free) - take:]
        del self.free[len(self.free) - take:]
        for b in got:
            self.ref[b] = 1
        self.used += take
        return got + [self.alloc() for _ in range(n - take)]

    def alloc(self) -> int:
        if self.free:
            b = self.free.pop()
        else:
            b, _ = self.lru.popitem(last=False)
            h = self.hash[b]
            if h is not None and self.cached.get(h) == b:
                del self.cached[h]
                self.events.append(removed(h))
            self.hash[b] = None
            self.evictions += 1
        self.ref[b] = 1
        self.used += 1
        return b

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.used -= 1
                h = self.hash[b]
                if h is not None and self.cached.get(h) == b:
                    self.lru[b] = None
                else:
                    self.hash[b] = None
                    self.free.append(b)

    def register(self, r: EngineRequest, before: int) -> None:
        bs = self.block_size
        end = min(r.num_computed // bs, len(r.block_hashes), len(r.blocks))
        run = -1
        for i in range(before // bs, end):
            h = r.block_hashes[i]
            if h not in self.cached:
                self.hash[r.blocks[i]] = h
                self.cached[h] = r.blocks[i]
                run = i if run < 0 else run
            elif run >= 0:
                self._stored(r, run, i)
                run = -1
        if run >= 0:
            self._stored(r, run, end)

    def _stored(self, r: EngineRequest, first: int, end: int) -> None:
        assert r.token_ids is not None
        bs = self.block_size
        self.events.append(stored(r.block_hashes[first:end], r.block_hashes[first - 1] if first else None,
                                  r.token_ids[first * bs:end * bs], bs))


def same_state(pool: BlockPool, ref: ReferencePool) -> None:
    assert list(pool._ref) == ref.ref
    assert [pool._hash[b] if pool._owned[b] else None for b in range(len(ref.hash))] == ref.hash
    assert list(pool._free) == ref.free
    assert list(pool._evictable) == list(ref.lru)
    assert pool._cached == ref.cached
    assert (pool.used, pool.evictions, pool.num_free) == (ref.used, ref.evictions, ref.num_free)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(4, 64), block_size=st.sampled_from([1, 4]),
       bulk=st.sampled_from([1, 6, 10**9]))
def test_bulk_blocks_equal_one_at_a_time(seed: int, num_blocks: int, block_size: int, bulk: int) -> None:
    """``bulk``: the pool's calls take their numpy path from this many blocks on (1:
    always, 10**9: never, 6: both, by the request)."""
    saved, block_lru.BULK = block_lru.BULK, bulk
    try:
        bulk_against_reference(seed, num_blocks, block_size)
    finally:
        block_lru.BULK = saved


def bulk_against_reference(seed: int, num_blocks: int, block_size: int) -> None:
    rng = random.Random(seed)
    pool, ref = BlockPool(num_blocks, block_size), ReferencePool(num_blocks, block_size)
    pool.enable_kv_events()
    prefixes = [[rng.randrange(1 << 60) for _ in range(24)] for _ in range(4)]  # shared prompt heads
    tail_hashes = [rng.randrange(1 << 60) for _ in range(6)]
    running: list[EngineRequest] = []
    for step in range(150):
        if running and (rng.random() < 0.4 or pool.num_free == 0):
            r = running.pop(rng.randrange(len(running)))  # finishes
            pool.release(r.blocks)
            ref.release(r.blocks)
        elif pool.num_free:
            head = rng.choice(prefixes)[: rng.randrange(1, 24)]
            # tails drawn from a small set: a tail block's hash is sometimes cached
            # already (by another request's block) though the block before it is not
            tail = [rng.choice(tail_hashes) if rng.random() < 0.3 else rng.randrange(1 << 60)
                    for _ in range(rng.randrange(0, 8))]
            hashes = list(dict.fromkeys(head + tail))  # a chain never repeats a hash
            r = EngineRequest(f"r{step}", len(hashes) * block_size, hashes, 1, 0.0,
                              token_ids=[rng.randrange(1000) for _ in range(len(hashes) * block_size)])
            hits = pool.lookup(hashes, len(hashes))
            assert hits == ref.lookup(hashes, len(hashes))
            # the blocks it asks for, within what is free beside the hits it pulls out
            idle_hits = pool.num_idle(hits)
            want = min(len(hashes) - len(hits), pool.num_free - idle_hits)
            pool.share(hits)
            ref.share(hits)
            blocks = list(hits)
            pool.alloc_many(want, blocks)
            assert blocks == hits + ref.alloc_many(want)
            r.blocks = blocks
            # computed so far: some blocks may not be (a prompt still being prefilled)
            r.num_computed = rng.randrange(len(hits), len(blocks) + 1) * block_size
            pool.register_computed(r, len(hits) * block_size)
            ref.register(r, len(hits) * block_size)
            running.append(r)
        same_state(pool, ref)
        assert pool.take_kv_events() == ref.events
        ref.events = []
