"""The admission rule interface and the narrow, read-only view of a region the rules read.

A rule looks at one new request at ``now`` and either refuses it (a :class:`Refusal`: the
status, code, message and Retry-After the client gets) or lets the next rule decide
(None). Rules are pure: they read the region only through :class:`RegionView` and keep
what they need of the settings from when they were built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from skymesh.routing.base import RoutingRequest


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is not queued: the error the client gets before any byte."""

    status: int
    code: str
    message: str
    retry_after_s: float | None = None


class RegionView(Protocol):
    """What admission may read of a region, and nothing it may change."""

    @property
    def queue_length(self) -> int: ...

    def service_rate_per_s(self, now: float) -> float | None:
        """How fast the queue drains (requests per second); None with too little history."""
        ...

    def soonest_local_first_token_s(self, req: RoutingRequest, now: float) -> float | None:
        """When a replica here would start ``req``'s first token at the soonest; None
        without a drain rate or a replica to go by."""
        ...

    def soonest_peer_first_token_s(self, req: RoutingRequest, now: float) -> float:
        """When a peer region would start ``req``'s first token at the soonest (inf: none)."""
        ...

    def nothing_can_serve(self, req: RoutingRequest, now: float) -> bool:
        """No replica ``req`` may use is healthy or unprobed and no allowed peer is alive."""
        ...

    def why_nothing_can_serve(self, req: RoutingRequest, now: float) -> str:
        """Where ``req`` may run and why none of it is reachable (for the 503's message)."""
        ...


class AdmissionRule(Protocol):
    def check(self, req: RoutingRequest, now: float, region: RegionView) -> Refusal | None:
        """A refusal for ``req`` at ``now``, or None: the next rule decides."""
        ...


def first_refusal(
    rules: tuple[AdmissionRule, ...], req: RoutingRequest, now: float, region: RegionView
) -> Refusal | None:
    """The refusal of the first rule, in order, that refuses ``req``; None if all admit it."""
    for rule in rules:
        refusal = rule.check(req, now, region)
        if refusal is not None:
            return refusal
    return None
