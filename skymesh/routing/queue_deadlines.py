"""When queued requests run out of wait: the region's queue-wait deadlines in time order.

:class:`QueueDeadlines` is a heap of ``(deadline, request id)``, armed each time a request
is queued and popped with ``now`` once due. It never learns that a request moved on
(placed, ended, queued again under a new deadline): the coordinator skips entries that no
longer hold, which keeps arming O(log n) and leaves nothing to remove.
"""

from __future__ import annotations

import heapq


class QueueDeadlines:
    """Queue-wait deadlines, soonest first; stale entries are the caller's to skip."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        # (deadline, arming order, request id): the order breaks ties without comparing ids
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def arm(self, request_id: str, deadline: float) -> None:
        """``request_id`` gets 504 at ``deadline`` if it is still queued under it then."""
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, request_id))

    def due(self, now: float) -> list[tuple[float, str]]:
        """Take every ``(deadline, request id)`` at or before ``now``, soonest first."""
        heap = self._heap
        out: list[tuple[float, str]] = []
        while heap and heap[0][0] <= now:
            deadline, _, request_id = heapq.heappop(heap)
            out.append((deadline, request_id))
        return out
