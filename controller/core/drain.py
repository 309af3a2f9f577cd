"""When a draining replica's drain ends.

A replica its source removed stays in the topology marked draining (its balancers send it
nothing new) until ``membership.drain_grace_s`` has passed or every live balancer of the
region that owns it has reported, at a topology version that already marks it draining,
nothing in flight on it. A fleet's members each place requests on it, and one's word is
not another's: one member that has not reported, or reported it busy, keeps it draining.

A balancer's load comes from its admin JSON, an untrusted shape: :meth:`MemberLoad.from_admin`
keeps what the verdict reads, and anything not stated as an integer proves nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

GRACE = "grace"
IDLE = "idle"
DrainEnd = Literal["grace", "idle"]


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True, slots=True)
class MemberLoad:
    """What one balancer's report says of the replicas it places requests on."""

    # the topology version the report was made at (None: not stated as an integer)
    topology_version: int | None
    # replica id -> requests in flight on it (None: its entry states no integer); None
    # for the whole map when the report has no readable ``replicas`` object
    in_flight: Mapping[str, int | None] | None

    @classmethod
    def from_admin(cls, admin: object) -> MemberLoad | None:
        """The load an admin JSON object states (None: it is no object at all)."""
        if not isinstance(admin, Mapping):
            return None
        replicas = admin.get("replicas")
        in_flight: dict[str, int | None] | None = None
        if isinstance(replicas, Mapping):
            # a null entry is no entry: the balancer does not hold that replica
            in_flight = {rid: _int(entry.get("in_flight")) if isinstance(entry, Mapping) else None
                         for rid, entry in replicas.items() if isinstance(rid, str) and entry is not None}
        return cls(topology_version=_int(admin.get("topology_version")), in_flight=in_flight)

    def idle_on(self, replica_id: str, drain_version: int) -> bool:
        """Whether this report, made at ``drain_version`` or later, shows nothing in flight
        on the replica (a balancer that does not hold it at all has nothing on it)."""
        if self.topology_version is None or self.topology_version < drain_version or self.in_flight is None:
            return False
        if replica_id not in self.in_flight:
            return True
        return self.in_flight[replica_id] == 0


def all_reported_idle(replica_id: str, drain_version: int, loads: Sequence[MemberLoad | None]) -> bool:
    """Whether every live balancer of the owning region (at least one) reported the
    replica idle at a version that marks it draining."""
    return bool(loads) and all(x is not None and x.idle_on(replica_id, drain_version) for x in loads)


def loads_of(reports: object) -> list[MemberLoad | None]:
    """A region's live members' loads from what a caller passed: each a :class:`MemberLoad`,
    an admin JSON object (read with :meth:`MemberLoad.from_admin`) or None (not reported).
    Anything but a list or tuple is no report at all."""
    if not isinstance(reports, (list, tuple)):
        return []
    return [r if isinstance(r, MemberLoad) else MemberLoad.from_admin(r) for r in reports]


def drain_end(replica_id: str, drain_version: int, draining_for_s: float, grace_s: float,
              loads: Sequence[MemberLoad | None]) -> DrainEnd | None:
    """Why the replica's drain ends now (the grace period passed, or every live balancer
    of its owner reported it idle), or None: it drains on."""
    if draining_for_s >= grace_s:
        return GRACE
    if all_reported_idle(replica_id, drain_version, loads):
        return IDLE
    return None
