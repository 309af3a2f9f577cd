"""The balancers of a region as the controller sees them: one record per member.

A region is a fleet of active-active balancers behind its entry. Each member registers on
its own (its own epoch), is probed on its own listener (or, where that listener is not an
address the controller can reach, kept alive by its reports) and dies on its own; the
region is alive while any member is (controller/service.py).

Who the members are depends on the region's ``balancer.fleet``:

- ``listed``: the config's members (``balancer:`` and ``balancer.siblings``); a
  registration is matched to one by its balancer id (the member's id), else by its own
  gRPC address when that is a dialable one the config lists; a region of one balancer
  takes a registration of any id (a fresh id per process, as a lone balancer always
  had). A registration the config does not list is a member too, known by its id.
- ``registered`` (an Auto Scaling group: every instance boots from one config): the config
  lists none; every registration is its own member, matched by its balancer id alone (the
  instance id), alive by its reports. Distinct ids are never folded onto one member.

A wildcard address (0.0.0.0, ::) is never published: siblings would dial themselves.
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
    # the epoch the balancer chose itself (its RegisterRequest.epoch): what its sibling
    # messages carry, published so siblings refuse any other (0: not registered yet)
    instance_epoch: int = 0

    @property
    def name(self) -> str:
        return self.balancer_id or self.key

    def as_json(self) -> dict[str, Any]:
        return {"key": self.key, "balancer_id": self.balancer_id, "alive": self.alive, "draining": self.draining,
                "epoch": self.epoch, "http_url": self.http_url, "grpc_address": self.grpc_address,
                "last_seen_unix_ms": self.last_seen_ms, "configured": self.configured,
                "instance_epoch": self.instance_epoch}

    @property
    def published_grpc_address(self) -> str:
        """Its gRPC address as the topology gives it: "" for a wildcard (never dialled)."""
        return self.grpc_address if dialable(self.grpc_address) else ""


def _reachable(hp: HostPort) -> bool:
    """Whether the controller can dial this listener (not a wildcard bind)."""
    try:
        return not ipaddress.ip_address(hp.host).is_unspecified
    except ValueError:
        return bool(hp.host)  # a host name


def dialable(address: str) -> bool:
    """Whether ``host:port`` names a host one can dial (not empty, not a wildcard)."""
    host, sep, _port = address.rpartition(":")
    host = host.strip("[]")
    return bool(sep and host) and _reachable(HostPort(host, 0))


def configured_members(region: RegionConfig) -> list[MemberState]:
    """The members the config lists (none for a registered fleet). A region of one
    balancer is probed on its advertised URL (what clients use, as always); a fleet's
    members on their own listeners."""
    if region.balancer.fleet == "registered":
        return []
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
    configured member of that id or of that (dialable) gRPC listener, else the only member
    of a listed region of one balancer (whatever its id); None: a new member."""
    if balancer_id:
        for m in members:
            if m.balancer_id == balancer_id or (m.configured and m.key == balancer_id):
                return m
    if member_grpc_address and dialable(member_grpc_address):
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
