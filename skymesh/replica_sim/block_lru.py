"""The idle cached blocks of an engine in least-recently-used order, as an append-only
queue of block ids with each member's position in it (both flat integer arrays).

It replaces an ``OrderedDict[int, None]``, which costs about a hundred bytes per idle block
(its hash-table entry and its link node): an engine's prefix cache fills with thousands of
idle blocks, and a 1,000-engine simulation held most of its memory there. The order kept
is the same (oldest first: a block appended when it becomes idle, taken out when it is
shared or evicted).

A block taken out of the middle (shared again) only forgets its position: its entry stays
in the queue, stale, and is skipped when the oldest are taken. So every operation is a
few array reads and writes, and a request's hundreds of blocks go in or out in one call
(:meth:`extend`, :meth:`remove_many`, :meth:`pop_oldest_many`) rather than a call per
block, which is what a day of long prompts spent most of its time on. The queue is
compacted (live entries moved to its front, in order) once stale entries outnumber live
ones by the engine's size, so it never holds more than three entries per block of the
engine.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence

_NONE = -1


class BlockLru:
    """A set of block ids of ``0 .. num_blocks - 1`` kept in the order they were added."""

    __slots__ = ("_pos", "_queue", "_head", "_len", "_num_blocks")

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        # per block: its index in _queue while a member, else _NONE
        self._pos = array("i", [_NONE]) * num_blocks
        self._queue = array("i")  # block ids in the order added; an entry is live iff _pos[b] is its index
        self._head = 0  # entries before it are all stale
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, block: int) -> bool:
        return self._pos[block] != _NONE

    def __iter__(self) -> Iterator[int]:
        """Oldest first."""
        pos, queue = self._pos, self._queue
        for i in range(self._head, len(queue)):
            b = queue[i]
            if pos[b] == i:
                yield b

    def append(self, block: int) -> None:
        """``block`` (not in the set) becomes the newest."""
        if self._pos[block] != _NONE:
            raise ValueError(f"block {block} is already in the LRU order")
        self._pos[block] = len(self._queue)
        self._queue.append(block)
        self._len += 1
        self._maybe_compact()

    def extend(self, blocks: Iterable[int]) -> None:
        """Each of ``blocks`` (none in the set, no repeats) becomes the newest, in turn:
        the same as appending them one by one."""
        pos, queue = self._pos, self._queue
        start = i = len(queue)
        for b in blocks:
            if pos[b] != _NONE:
                # undo this call's additions, so a refused call changes nothing
                for j in range(start, i):
                    pos[queue[j]] = _NONE
                del queue[start:]
                raise ValueError(f"block {b} is already in the LRU order")
            pos[b] = i
            queue.append(b)
            i += 1
        self._len += i - start
        self._maybe_compact()

    def remove(self, block: int) -> None:
        """Take ``block`` out (KeyError when it is not in the set)."""
        if self._pos[block] == _NONE:
            raise KeyError(block)
        self._pos[block] = _NONE
        self._len -= 1

    def remove_many(self, blocks: Sequence[int]) -> None:
        """Take each of ``blocks`` out (every one a member, no repeats; KeyError, with
        nothing taken out, otherwise)."""
        pos = self._pos
        for b in blocks:
            if pos[b] == _NONE:
                raise KeyError(b)
        for b in blocks:
            pos[b] = _NONE
        self._len -= len(blocks)

    def pop_oldest(self) -> int:
        """Take out and return the oldest block (KeyError when empty)."""
        if not self._len:
            raise KeyError("pop from an empty LRU order")
        return self.pop_oldest_many(1)[0]

    def pop_oldest_many(self, n: int) -> list[int]:
        """Take out and return the ``n`` oldest blocks, oldest first (KeyError, with
        nothing taken out, when fewer are in the set)."""
        if n > self._len:
            raise KeyError(f"{n} blocks asked of an LRU order of {self._len}")
        pos, queue = self._pos, self._queue
        out: list[int] = []
        i = self._head
        while len(out) < n:
            b = queue[i]
            if pos[b] == i:
                pos[b] = _NONE
                out.append(b)
            i += 1
        self._head = i
        self._len -= n
        self._maybe_compact()
        return out

    def clear(self) -> None:
        pos, queue = self._pos, self._queue
        for i in range(self._head, len(queue)):
            b = queue[i]
            if pos[b] == i:
                pos[b] = _NONE
        self._queue = array("i")
        self._head = 0
        self._len = 0

    def _maybe_compact(self) -> None:
        """Move the live entries to the front, in order, once the stale ones (skipped
        before the head, or left by a removal) outnumber them by the engine's size."""
        queue = self._queue
        if len(queue) - self._len <= self._len + self._num_blocks:
            return
        pos = self._pos
        live = array("i", (b for i, b in enumerate(queue) if i >= self._head and pos[b] == i))
        for i, b in enumerate(live):
            pos[b] = i
        self._queue = live
        self._head = 0
