"""What a region core asks its driver to do: the actions out of
:class:`~skymesh.routing.region.RegionCore`. The daemon carries them out with sockets, the
simulator on its clock; both read only these four."""

from __future__ import annotations

from dataclasses import dataclass

from skymesh.routing.base import Decision


@dataclass(frozen=True, slots=True)
class SendToReplica:
    request_id: str
    replica_id: str
    decision: Decision


@dataclass(frozen=True, slots=True)
class ForwardToRegion:
    request_id: str
    region: str


@dataclass(frozen=True, slots=True)
class Reject:
    """End the request with an error before any byte reached the client."""

    request_id: str
    status: int
    code: str
    message: str
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class AbandonAttempt:
    """Stop the attempt in progress on ``target``: the request is queued again already
    (its replica was ejected or left membership, or its peer region went down, before it
    produced a byte), or a :class:`Reject` for it follows in the same actions."""

    request_id: str
    target: str


Action = SendToReplica | ForwardToRegion | Reject | AbandonAttempt
