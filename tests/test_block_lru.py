"""The engine's array-backed LRU order of idle cached blocks keeps exactly the order an
``OrderedDict`` keeps, under any sequence of the block pool's operations, one block at a
time or a request's blocks at once (and through its queue's compactions)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.replica_sim import block_lru
from skymesh.replica_sim.block_lru import BlockLru


@settings(max_examples=100, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(1, 40))
def test_the_order_equals_an_ordered_dict_after_every_operation(seed: int, num_blocks: int) -> None:
    rng = random.Random(seed)
    lru, reference = BlockLru(num_blocks), OrderedDict[int, None]()
    for _ in range(400):
        kind = rng.randrange(5)
        b = rng.randrange(num_blocks)
        if kind <= 1 and b not in reference:  # a block becomes idle
            lru.append(b)
            reference[b] = None
        elif kind == 2 and b in reference:  # shared again
            lru.remove(b)
            del reference[b]
        elif kind == 3 and reference:  # evicted
            assert lru.pop_oldest() == reference.popitem(last=False)[0]
        elif kind == 4 and rng.random() < 0.05:
            lru.clear()
            reference.clear()
        assert list(lru) == list(reference)
        assert len(lru) == len(reference) and bool(lru) == bool(reference)
        assert all((k in lru) == (k in reference) for k in range(num_blocks))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(1, 40), bulk=st.sampled_from([1, 8, 10**9]))
def test_the_bulk_operations_equal_one_block_at_a_time(seed: int, num_blocks: int, bulk: int) -> None:
    """extend / remove_many / pop_oldest_many leave the order an OrderedDict has after the
    same blocks one by one, on their numpy path (``bulk`` 1: every call), their loop
    (10**9: none) or both; 600 operations on at most 40 blocks compact the queue many
    times over."""
    saved, block_lru.BULK = block_lru.BULK, bulk
    try:
        bulk_operations(seed, num_blocks)
    finally:
        block_lru.BULK = saved


def bulk_operations(seed: int, num_blocks: int) -> None:
    rng = random.Random(seed)
    lru, reference = BlockLru(num_blocks), OrderedDict[int, None]()
    for _ in range(600):
        kind = rng.randrange(4)
        if kind == 0:  # a request's blocks become idle, last first
            out = [b for b in range(num_blocks) if b not in reference]
            rng.shuffle(out)
            some = out[: rng.randrange(len(out) + 1)]
            lru.extend(some)
            reference.update(dict.fromkeys(some))
        elif kind == 1 and reference:  # prefix hits share some idle blocks again
            some = rng.sample(list(reference), rng.randrange(len(reference) + 1))
            lru.remove_many(some)
            for b in some:
                del reference[b]
        elif kind == 2 and reference:  # a long prompt evicts the oldest
            n = rng.randrange(len(reference) + 1)
            assert lru.pop_oldest_many(n) == [reference.popitem(last=False)[0] for _ in range(n)]
        elif kind == 3 and reference and rng.random() < 0.5:  # one at a time, interleaved
            b = rng.choice(list(reference))
            lru.remove(b)
            del reference[b]
            lru.append(b)
            reference[b] = None
        assert list(lru) == list(reference)
        assert len(lru) == len(reference)
        assert all((k in lru) == (k in reference) for k in range(num_blocks))
        # stale entries are compacted away: the queue stays within a few times the
        # engine's size, whatever the history
        assert lru._tail <= 3 * num_blocks + 16


def test_misuse_is_refused() -> None:
    lru = BlockLru(3)
    lru.append(1)
    with pytest.raises(ValueError):
        lru.append(1)
    with pytest.raises(KeyError):
        lru.remove(2)
    assert lru.pop_oldest() == 1
    with pytest.raises(KeyError):
        lru.pop_oldest()


def test_a_refused_bulk_call_changes_nothing() -> None:
    lru = BlockLru(5)
    lru.extend([3, 1])
    with pytest.raises(ValueError):
        lru.extend([0, 4, 1])  # 1 is already there: 0 and 4 are not added either
    assert list(lru) == [3, 1] and 0 not in lru and 4 not in lru
    with pytest.raises(KeyError):
        lru.remove_many([3, 2])  # 2 is not there: 3 stays
    assert list(lru) == [3, 1]
    with pytest.raises(KeyError):
        lru.pop_oldest_many(3)
    assert list(lru) == [3, 1] and len(lru) == 2


@pytest.mark.parametrize("bulk", [1, 10**9])
def test_an_addition_that_would_not_fit_compacts_first(bulk: int) -> None:
    """The queue holds three entries per block: a whole engine's blocks made idle and
    shared again, over and over, leave stale entries under the compaction threshold until
    an addition no longer fits; it compacts first and keeps the order."""
    saved, block_lru.BULK = block_lru.BULK, bulk
    try:
        n = 64
        lru, reference = BlockLru(n), OrderedDict[int, None]()
        rng = random.Random(7)
        for _ in range(12):
            blocks = list(range(n))
            rng.shuffle(blocks)
            lru.extend(blocks)
            reference.update(dict.fromkeys(blocks))
            assert list(lru) == list(reference)
            lru.remove_many(blocks)
            reference.clear()
            assert not list(lru) and lru._tail <= len(lru._queue)
    finally:
        block_lru.BULK = saved
