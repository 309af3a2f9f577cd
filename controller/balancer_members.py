"""The balancers of a region as the controller sees them: one record per member.

A region is a fleet of active-active balancers behind its entry. Each member registers on
its own (its own epoch), is probed on its own listener (or, where that listener is not an
address the controller can reach, kept alive by its reports) and dies on its own; the
region is alive while any member is (controller/service.py). The config lists the members
it knows (``balancer:`` and ``balancer.siblings``); a registration it does not list is a
member too, known by its balancer id, alive by its reports alone.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from skymesh.config import HostPort, RegionConfig

# a member the controller cannot probe is dead after this long without a report or
# registration (balancers report every second) and failure_threshold probe rounds
UNPROBED_REPORT_STALE_S = 3.0


@dataclass
class MemberState:
    """One balancer of a region."""

    # the configured member id (<region>-bK), or the balancer id of a member the config
    # does not list; the key it is persisted under
    key: str
    configured: bool
    # its own listeners: where it answers HTTP, its own gRPC (the sibling channel)
    http_url: str
    grpc_address: str
    # what the probe asks for /health ("": none, liveness by its reports alone)
    probe_url: str
    balancer_id: str = ""  # of its current registration ("": not registered yet)
    epoch: int = 0  # issued to its current registration
    alive: bool = True  # presumed until probes or a deregistration say otherwise
    draining: bool = False  # deregistered: out until it registers again
    failures: int = 0  # consecutive failed probes
    last_seen_ms: int | None = None

    @property
    def name(self) -> str:
        return self.balancer_id or self.key

    def as_json(self) -> dict[str, Any]:
        return {"key": self.key, "balancer_id": self.balancer_id, "alive": self.alive, "draining": self.draining,
                "epoch": self.epoch, "http_url": self.http_url, "grpc_address": self.grpc_address,
                "last_seen_unix_ms": self.last_seen_ms, "configured": self.configured}


def _reachable(hp: HostPort) -> bool:
    """Whether the controller can dial this listener (not a wildcard bind)."""
    try:
        return not ipaddress.ip_address(hp.host).is_unspecified
    except ValueError:
        return bool(hp.host)  # a host name


def configured_members(region: RegionConfig) -> list[MemberState]:
    """The members the config lists. A region of one balancer is probed on its advertised
    URL (what clients use, as always); a fleet's members on their own listeners."""
    members = region.balancer_members
    if len(members) == 1:
        m = members[0]
        return [MemberState(key=m.id, configured=True, http_url=m.listen.http_url, grpc_address=str(m.grpc_listen),
                            probe_url=region.balancer.advertise_url)]
    return [MemberState(key=m.id, configured=True, http_url=m.listen.http_url, grpc_address=str(m.grpc_listen),
                        probe_url=m.listen.http_url if _reachable(m.listen) else "")
            for m in members]


def member_of_registration(members: list[MemberState], balancer_id: str, member_grpc_address: str) -> MemberState | None:
    """The member a registration speaks for: the one registered under this id, else the
    configured member of that id or of that gRPC listener, else the only member of a
    region of one balancer (whatever its id); None: a member the config does not list."""
    if balancer_id:
        for m in members:
            if m.balancer_id == balancer_id or (m.configured and m.key == balancer_id):
                return m
    if member_grpc_address:
        for m in members:
            if m.configured and m.grpc_address == member_grpc_address:
                return m
    configured = [m for m in members if m.configured]
    if len(configured) == 1 and len(members) == 1:
        return configured[0]
    return None


def registered_member(members: list[MemberState], balancer_id: str) -> MemberState | None:
    """The member whose current registration has this balancer id; for a region of one
    balancer also a call without one (an older balancer), judged by its epoch."""
    for m in members:
        if m.epoch and m.balancer_id and m.balancer_id == balancer_id:
            return m
    if len(members) == 1 and not balancer_id:
        return members[0]
    return None
