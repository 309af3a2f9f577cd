"""Where a request may run: each replica's home region against the offload rules.

The rules that decide offload (``allowed(origin, region)``) decide every other move across
regions too: a request never runs on a replica whose home region its origin may not
reach, including replicas adopted from a failed region and this region's own replicas
when failover brought it another region's clients. :class:`Residency` answers which
replicas are closed to a request, and whether anything at all, here or at a peer, may
still serve it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from skymesh.routing.base import RoutingRequest
from skymesh.routing.health import ReplicaHealth
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.pairing.base import Role, does_decode, does_prefill


class Residency:
    """The replicas' home regions and, per request origin, the replicas closed to it
    (cached per origin until membership or the rules change)."""

    __slots__ = ("_region", "_offload", "_health", "_home", "_adopted", "_forbidden_by_origin", "_prefill_only",
                 "_decode_only")

    def __init__(self, region: str, offload: OffloadRouter, health: ReplicaHealth) -> None:
        self._region = region
        self._offload = offload  # its ``allowed`` rules, and which peers could serve
        self._health = health
        self._home: dict[str, str] = {}  # replica -> the region it lives in
        self._adopted = False  # some replica lives in another region (failover)
        self._forbidden_by_origin: dict[str, frozenset[str]] = {}
        # prefill/decode roles (skymesh/routing/pairing): a request needs a replica that may
        # prefill and one that may decode; a replica of role ``both`` is each
        self._prefill_only: frozenset[str] = frozenset()
        self._decode_only: frozenset[str] = frozenset()

    @property
    def adopted(self) -> bool:
        """Some replica here lives in another region (adopted on failover)."""
        return self._adopted

    def set_homes(self, replica_ids: Sequence[str], homes: Mapping[str, str] | None) -> None:
        """Membership: ``homes`` maps a replica to its region when not this one."""
        self._home = {rid: (homes or {}).get(rid, self._region) for rid in replica_ids}
        self._adopted = any(home != self._region for home in self._home.values())
        self._forbidden_by_origin.clear()

    def set_roles(self, roles: Mapping[str, Role]) -> None:
        """Each replica's role (missing: ``both``)."""
        self._prefill_only = frozenset(rid for rid, role in roles.items() if not does_decode(role))
        self._decode_only = frozenset(rid for rid, role in roles.items() if not does_prefill(role))

    def rules_changed(self) -> None:
        """The offload rules were reloaded: what was computed from the old ones goes."""
        self._forbidden_by_origin.clear()

    def forbidden_replicas(self, req: RoutingRequest) -> frozenset[str]:
        """Replicas whose home region the offload rules close to this request's origin."""
        origin = req.origin_region
        if origin is None and not self._adopted:
            return frozenset()  # this region's own clients on this region's own replicas
        return self.forbidden_to(origin or self._region)

    def closes_any_to(self, origin: str) -> bool:
        """Some replica here is closed to a request from ``origin``. A request forwarded by
        a peer names the sender's region as its origin; the sender forwarded it only where
        the rules allow, so this is false for it unless the rules or the replicas' homes
        changed since (or it is a failover's client under a rule that keeps it off them)."""
        return bool(self.forbidden_to(origin))

    def forbidden_to(self, origin: str) -> frozenset[str]:
        """Replicas whose home region the offload rules close to requests from ``origin``."""
        got = self._forbidden_by_origin.get(origin)
        if got is None:
            allowed = self._offload.allowed
            got = frozenset(rid for rid, home in self._home.items() if home != origin and not allowed(origin, home))
            self._forbidden_by_origin[origin] = got
        return got

    def why_nothing_can_serve(self, req: RoutingRequest, now: float) -> str:
        """Why :meth:`nothing_can_serve` holds, in words a client can act on: which
        regions the request may run in and that none of them is reachable now (a region
        between owners: its balancer down, or back and not yet heard from)."""
        origin = req.origin_region or self._region
        allowed = self._offload.allowed
        regions = sorted({home for home in self._home.values() if allowed(origin, home)}
                         | {r for r in self._offload.peers if allowed(origin, r)}
                         | ({origin} if allowed(origin, origin) else set()))
        if req.forwarded:
            return "this region's replicas that may serve it are all unhealthy; Retry-After says when to try again"
        closed = self.forbidden_replicas(req)
        if closed and len(closed) == len(self._home):
            here = "every replica here is closed to it by the residency rules"
        elif self._health.any_usable(excluding=closed | self._decode_only):
            here = "no replica here that may decode it (role decode or both) is healthy"
        elif self._health.any_usable(excluding=closed | self._prefill_only):
            here = "no replica here that may prefill it (role prefill or both) is healthy"
        else:
            here = "no replica here that it may use is healthy"
        where = ", ".join(regions) if regions else "none"
        return (f"requests from {origin} may run in {where} only; {here} and no balancer of those regions "
                "is reachable from here now (down, or between owners in a failover); Retry-After says when to try again")

    def nothing_can_serve(self, req: RoutingRequest, now: float) -> bool:
        """No replica this request may use is healthy or still unprobed, and no allowed
        peer region is alive with replicas: queueing it could only end in a timeout. With
        prefill/decode roles it needs both sides: a replica that may prefill it and one
        that may decode it."""
        closed = self.forbidden_replicas(req)
        usable = self._health.any_usable
        if not self._prefill_only and not self._decode_only:
            if usable(excluding=closed):
                return False
        elif usable(excluding=closed | self._decode_only) and usable(excluding=closed | self._prefill_only):
            return False
        return req.forwarded or not self._offload.could_serve(now, req.origin_region, req.slo_ttft_s)
