"""The idle cached blocks of an engine in least-recently-used order, as a doubly linked
list over block ids held in two flat integer arrays.

It replaces an ``OrderedDict[int, None]``, which costs about a hundred bytes per idle block
(its hash-table entry and its link node): an engine's prefix cache fills with thousands of
idle blocks, and a 1,000-engine simulation held most of its memory there. Here the cost
is two 4-byte slots per block of the engine, whatever is cached; the order kept is the
same (oldest first: a block appended when it becomes idle, taken out when it is shared or
evicted).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

_NONE = -1


class BlockLru:
    """A set of block ids of ``0 .. num_blocks - 1`` kept in the order they were added."""

    __slots__ = ("_prev", "_next", "_member", "_head", "_tail", "_len")

    def __init__(self, num_blocks: int) -> None:
        self._prev = array("i", [_NONE]) * num_blocks
        self._next = array("i", [_NONE]) * num_blocks
        self._member = bytearray(num_blocks)
        self._head = _NONE  # the oldest
        self._tail = _NONE  # the newest
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, block: int) -> bool:
        return bool(self._member[block])

    def __iter__(self) -> Iterator[int]:
        """Oldest first."""
        nxt = self._next
        b = self._head
        while b != _NONE:
            yield b
            b = nxt[b]

    def append(self, block: int) -> None:
        """``block`` (not in the set) becomes the newest."""
        if self._member[block]:
            raise ValueError(f"block {block} is already in the LRU order")
        self._member[block] = 1
        tail = self._tail
        self._prev[block] = tail
        self._next[block] = _NONE
        if tail == _NONE:
            self._head = block
        else:
            self._next[tail] = block
        self._tail = block
        self._len += 1

    def remove(self, block: int) -> None:
        """Take ``block`` out (KeyError when it is not in the set)."""
        if not self._member[block]:
            raise KeyError(block)
        self._member[block] = 0
        prev, nxt = self._prev[block], self._next[block]
        if prev == _NONE:
            self._head = nxt
        else:
            self._next[prev] = nxt
        if nxt == _NONE:
            self._tail = prev
        else:
            self._prev[nxt] = prev
        self._len -= 1

    def pop_oldest(self) -> int:
        """Take out and return the oldest block (KeyError when empty)."""
        head = self._head
        if head == _NONE:
            raise KeyError("pop from an empty LRU order")
        self.remove(head)
        return head

    def clear(self) -> None:
        b = self._head
        nxt, member = self._next, self._member
        while b != _NONE:
            member[b] = 0
            b = nxt[b]
        self._head = self._tail = _NONE
        self._len = 0
