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
(:meth:`extend`, :meth:`remove_many`, :meth:`pop_oldest_many`), as numpy operations on
views of the same arrays once a call has :data:`BULK` blocks or more (a day of long
prompts spent most of its time moving blocks one by one). The queue is compacted (live
entries moved to its front, in order) once stale entries outnumber live ones by the
engine's size, or when an addition would not fit; its storage, three entries per block
of the engine, is allocated once.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

import numpy as np

_NONE = -1
# calls moving this many blocks or more use numpy; fewer, a plain loop (numpy's fixed
# cost per call is a few microseconds)
BULK = 32


class BlockLru:
    """A set of block ids of ``0 .. num_blocks - 1`` kept in the order they were added."""

    __slots__ = ("_pos", "_queue", "_pos_np", "_queue_np", "_head", "_tail", "_len", "_num_blocks")

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        # per block: its index in _queue while a member, else _NONE
        self._pos = array("i", [_NONE]) * num_blocks
        # block ids in the order added, in _queue[_head:_tail]; an entry is live iff
        # _pos[b] is its index. An addition that would not fit compacts first: the set
        # and the addition hold at most num_blocks, so a compaction leaves at least
        # 2 * num_blocks entries free (each costs O(1) amortized)
        self._queue = array("i", [0]) * (3 * num_blocks + 16)
        # numpy views of the same memory (the arrays are never resized)
        self._pos_np = np.frombuffer(self._pos, dtype=np.int32) if num_blocks else np.zeros(0, np.int32)
        self._queue_np = np.frombuffer(self._queue, dtype=np.int32)
        self._head = 0  # entries before it are all stale
        self._tail = 0
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
        for i in range(self._head, self._tail):
            b = queue[i]
            if pos[b] == i:
                yield b

    def append(self, block: int) -> None:
        """``block`` (not in the set) becomes the newest."""
        if self._pos[block] != _NONE:
            raise ValueError(f"block {block} is already in the LRU order")
        if self._tail == len(self._queue):
            self._compact()
        self._pos[block] = self._tail
        self._queue[self._tail] = block
        self._tail += 1
        self._len += 1
        self._maybe_compact()

    def extend(self, blocks: Sequence[int] | np.ndarray) -> None:
        """Each of ``blocks`` (none in the set, no repeats) becomes the newest, in turn:
        the same as appending them one by one (ValueError, nothing added, when one is in
        the set already)."""
        n = len(blocks)
        if self._tail + n > len(self._queue):
            self._compact()
        tail = self._tail
        if n >= BULK:
            idx = np.asarray(blocks, dtype=np.int32)
            if (self._pos_np[idx] != _NONE).any():
                raise ValueError("a block is already in the LRU order")
            self._pos_np[idx] = np.arange(tail, tail + n, dtype=np.int32)
            self._queue_np[tail:tail + n] = idx
        else:
            pos, queue = self._pos, self._queue
            for b in blocks:
                if pos[b] != _NONE:
                    raise ValueError(f"block {b} is already in the LRU order")
            for i, b in enumerate(blocks, tail):
                pos[b] = i
                queue[i] = b
        self._tail = tail + n
        self._len += n
        self._maybe_compact()

    def remove(self, block: int) -> None:
        """Take ``block`` out (KeyError when it is not in the set)."""
        if self._pos[block] == _NONE:
            raise KeyError(block)
        self._pos[block] = _NONE
        self._len -= 1

    def remove_many(self, blocks: Sequence[int] | np.ndarray) -> None:
        """Take each of ``blocks`` out (every one a member, no repeats; KeyError, with
        nothing taken out, otherwise)."""
        n = len(blocks)
        if n >= BULK:
            idx = np.asarray(blocks, dtype=np.int32)
            if (self._pos_np[idx] == _NONE).any():
                raise KeyError("a block is not in the LRU order")
            self._pos_np[idx] = _NONE
        else:
            pos = self._pos
            for b in blocks:
                if pos[b] == _NONE:
                    raise KeyError(b)
            for b in blocks:
                pos[b] = _NONE
        self._len -= n

    def pop_oldest(self) -> int:
        """Take out and return the oldest block (KeyError when empty)."""
        if not self._len:
            raise KeyError("pop from an empty LRU order")
        pos, queue = self._pos, self._queue
        i = self._head
        while True:
            b = queue[i]
            i += 1
            if pos[b] == i - 1:
                pos[b] = _NONE
                self._head = i
                self._len -= 1
                self._maybe_compact()
                return b

    def pop_oldest_many(self, n: int) -> list[int]:
        """Take out and return the ``n`` oldest blocks, oldest first (KeyError, with
        nothing taken out, when fewer are in the set)."""
        if n > self._len:
            raise KeyError(f"{n} blocks asked of an LRU order of {self._len}")
        if n < BULK:
            out = [self.pop_oldest() for _ in range(n)]
            return out
        pos_np, queue_np = self._pos_np, self._queue_np
        parts: list[np.ndarray] = []
        need, head = n, self._head
        while need:
            # the live entries of the next stretch of the queue, in order
            end = min(self._tail, head + 2 * need + BULK)
            chunk = queue_np[head:end]
            live = np.flatnonzero(pos_np[chunk] == np.arange(head, end, dtype=np.int32))
            if len(live) >= need:
                live = live[:need]
                end = head + int(live[-1]) + 1
            taken = chunk[live]
            parts.append(taken)
            need -= len(taken)
            head = end
        out = np.concatenate(parts) if len(parts) > 1 else parts[0]
        pos_np[out] = _NONE
        self._head = head
        self._len -= n
        self._maybe_compact()
        return out.tolist()

    def clear(self) -> None:
        pos, queue = self._pos, self._queue
        for i in range(self._head, self._tail):
            b = queue[i]
            if pos[b] == i:
                pos[b] = _NONE
        self._head = self._tail = self._len = 0

    def _maybe_compact(self) -> None:
        """Move the live entries to the front, in order, once the stale ones (skipped
        before the head, or left by a removal) outnumber them by the engine's size."""
        if self._tail - self._len > self._len + self._num_blocks:
            self._compact()

    def _compact(self) -> None:
        head, tail = self._head, self._tail
        pos_np, queue_np = self._pos_np, self._queue_np
        chunk = queue_np[head:tail]
        live = chunk[pos_np[chunk] == np.arange(head, tail, dtype=np.int32)].copy()
        queue_np[: len(live)] = live
        pos_np[live] = np.arange(len(live), dtype=np.int32)
        self._head, self._tail = 0, len(live)
