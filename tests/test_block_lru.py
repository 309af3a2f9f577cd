"""The engine's array-backed LRU order of idle cached blocks keeps exactly the order an
``OrderedDict`` keeps, under any sequence of the block pool's operations."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
