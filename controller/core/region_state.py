"""What the controller knows of each region, typed.

A region is a fleet of balancers (:class:`~controller.balancer_members.MemberState`, one
per member); the region as one endpoint (:class:`RegionRecord`) is derived from them by
:func:`controller.core.failover.refresh_region`. Each member's latest report is kept as
the decisions read it (:class:`MemberReport`); the region's latest report as sent, for
status, in :attr:`RegionState.last_admin` and :attr:`RegionState.last_report`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controller.balancer_members import MemberState
from controller.core.drain import MemberLoad
from controller.sibling_watch import bounded_names
from skymesh.proto_gen import mesh_pb2


@dataclass(frozen=True, slots=True)
class Now:
    """The one instant a decision is made at: wall-clock milliseconds (what is persisted
    and shown: when a balancer was last seen) and monotonic seconds (deadlines)."""

    wall_ms: int
    monotonic_s: float


@dataclass(slots=True)
class RegionRecord:
    """The region as one endpoint: what DNS, the topology and status publish. Alive while
    any of its balancers is, draining when all are, named by its latest registration."""

    balancer_id: str
    epoch: int
    alive: bool
    http_url: str
    grpc_address: str
    last_seen_ms: int | None
    draining: bool = False

@dataclass(frozen=True, slots=True)
class MemberReport:
    """One balancer's latest report as the decisions read it: when it came, the load its
    admin JSON states (drain verdicts) and the siblings it names unresponsive (the
    sibling watch; at most ``MAX_NAMED`` names, each short enough to be an id)."""

    at_ms: int
    load: MemberLoad | None
    unresponsive_siblings: frozenset[str]

    @classmethod
    def of(cls, admin: object, proto: mesh_pb2.BalancerReport, at_ms: int) -> MemberReport:
        return cls(at_ms=at_ms, load=MemberLoad.from_admin(admin),
                   unresponsive_siblings=bounded_names(proto.unresponsive_siblings))


@dataclass(slots=True)
class RegionState:
    """One region: its record, its balancers and their reports."""

    name: str
    record: RegionRecord
    members: list[MemberState]
    # a registered fleet none of whose balancers is known yet is presumed alive until
    # this monotonic instant (its first balancers' time to register)
    presumed_alive_until_s: float
    # the key of the member whose registration names the region (None: none yet)
    latest_member: str | None = None
    # member key -> its latest report since it registered
    member_reports: dict[str, MemberReport] = field(default_factory=dict)
    # the region's latest report from any of its balancers: its admin JSON (an untrusted
    # shape, shown as sent by status) and the report itself (GetStatus, replica roles)
    last_admin: dict[str, Any] | None = None
    last_report: mesh_pb2.BalancerReport | None = None

    def member(self, key: str) -> MemberState | None:
        return next((m for m in self.members if m.key == key), None)

    def live_loads(self) -> list[MemberLoad | None]:
        """The load each live member (alive, not draining) last reported, None for one
        that has not reported since it registered (or whose report was no JSON object):
        a replica's drain ends only when every one of them says it is idle."""
        out: list[MemberLoad | None] = []
        for m in self.members:
            if m.alive and not m.draining:
                rep = self.member_reports.get(m.key)
                out.append(rep.load if rep is not None else None)
        return out


@dataclass(frozen=True, slots=True)
class StoredRegion:
    """A region's record as the state file kept it (controller/state.py)."""

    balancer_id: str | None
    epoch: int | None
    alive: bool
    http_url: str | None
    grpc_address: str | None
    last_seen_ms: int | None


@dataclass(frozen=True, slots=True)
class StoredBalancer:
    """One balancer's record as the state file kept it (controller/state.py)."""

    balancer_id: str | None
    epoch: int | None
    alive: bool
    draining: bool
    http_url: str | None
    grpc_address: str | None
    last_seen_ms: int | None
    instance_epoch: int | None
