"""The states of a request a region accepted, and the moves between them.

One explicit state machine, which :class:`~skymesh.routing.region.RegionCore` enforces
on every move (anything else is a bug in the caller or the core)::

    queued ──> placed ──> streaming ──> done
      │  ^        │  │         │
      │  └────────┘  │         └──> failed | cancelled
      │   (retry)    └──> done | failed | cancelled
      └──> rejected | cancelled

``placed`` means sent to a replica or forwarded to a peer region and nothing has reached
the client yet; ``streaming`` means the first byte did.
"""

from __future__ import annotations

from enum import StrEnum


class RequestState(StrEnum):
    QUEUED = "queued"
    PLACED = "placed"
    STREAMING = "streaming"
    DONE = "done"
    FAILED = "failed"
    REJECTED = "rejected"
    CANCELLED = "cancelled"


TERMINAL = frozenset(
    {RequestState.DONE, RequestState.FAILED, RequestState.REJECTED, RequestState.CANCELLED}
)
# "new" is the state before submit; every other pair is a bug in the caller or the core
ALLOWED_TRANSITIONS: dict[str, frozenset[RequestState]] = {
    "new": frozenset({RequestState.QUEUED, RequestState.REJECTED}),
    RequestState.QUEUED: frozenset(
        {RequestState.PLACED, RequestState.REJECTED, RequestState.CANCELLED}
    ),
    RequestState.PLACED: frozenset(
        {
            RequestState.STREAMING,
            RequestState.QUEUED,  # retried before any byte reached the client
            RequestState.DONE,  # a whole non-200 answer passed through as the result
            RequestState.REJECTED,  # retries spent: the client gets one error
            RequestState.CANCELLED,
        }
    ),
    RequestState.STREAMING: frozenset(
        {RequestState.DONE, RequestState.FAILED, RequestState.CANCELLED}
    ),
}
