"""The balancer's queue of waiting requests, by priority: pure.

Requests of a higher priority (their SLO class's) are offered to the policy before any
of a lower one; within a priority, first come first served, and a request that already
waited (a retry, a request a peer bounced back) goes to the front of its own priority.
One ordered dict per priority present: with one priority (no SLO classes, the common
case) this is exactly the FCFS queue, and a lookup, insert or removal stays O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

Item = TypeVar("Item")


class PriorityQueue(Generic[Item]):
    """Items keyed by request id, iterated highest priority first, FIFO within one."""

    def __init__(self) -> None:
        self._lanes: dict[int, OrderedDict[str, Item]] = {}
        self._order: list[int] = []  # priorities present, highest first
        self._lane_of: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._lane_of)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._lane_of

    def __bool__(self) -> bool:
        return bool(self._lane_of)

    def get(self, request_id: str) -> Item | None:
        lane = self._lane_of.get(request_id)
        return None if lane is None else self._lanes[lane][request_id]

    def __getitem__(self, request_id: str) -> Item:
        return self._lanes[self._lane_of[request_id]][request_id]

    def push(self, request_id: str, item: Item, priority: int = 0, *, front: bool = False) -> None:
        if request_id in self._lane_of:
            raise ValueError(f"duplicate request id {request_id!r}")
        lane = self._lanes.get(priority)
        if lane is None:
            lane = self._lanes[priority] = OrderedDict()
            self._order.append(priority)
            self._order.sort(reverse=True)
        lane[request_id] = item
        if front:
            lane.move_to_end(request_id, last=False)
        self._lane_of[request_id] = priority

    def pop(self, request_id: str) -> Item | None:
        """Remove and return the item; None when it is not queued."""
        priority = self._lane_of.pop(request_id, None)
        if priority is None:
            return None
        lane = self._lanes[priority]
        item = lane.pop(request_id)
        if not lane:  # an empty priority leaves the order, so iteration never walks it
            del self._lanes[priority]
            self._order.remove(priority)
        return item

    def at_or_above(self, priority: int) -> int:
        """How many queued requests a new one of ``priority`` would wait behind."""
        return sum(len(self._lanes[p]) for p in self._order if p >= priority)

    def heads(self, n: int) -> list[tuple[int, list[Item]]]:
        """Each priority present (highest first) with its first ``n`` items."""
        out = []
        for p in self._order:
            lane = self._lanes[p]
            head = []
            for item in lane.values():
                if len(head) >= n:
                    break
                head.append(item)
            out.append((p, head))
        return out

    def reorder_head(self, priority: int, request_ids: list[str]) -> None:
        """Put ``request_ids`` (the first ones of ``priority``, in any order) first in their
        priority, in the order given; the rest of it keeps its order."""
        lane = self._lanes[priority]
        for rid in reversed(request_ids):
            lane.move_to_end(rid, last=False)

    def lanes(self) -> list[tuple[int, list[str]]]:
        """Each priority present (highest first) with its request ids in queue order (copies)."""
        return [(p, list(self._lanes[p])) for p in self._order]

    def ids(self) -> list[str]:
        """The request ids in queue order (a copy: the queue may change while it is walked)."""
        return [rid for p in self._order for rid in self._lanes[p]]

    def values(self) -> Iterator[Item]:
        """Items in queue order, lazily: the queue must not change meanwhile."""
        for p in self._order:
            yield from self._lanes[p].values()
