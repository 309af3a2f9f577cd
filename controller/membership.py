"""Dynamic membership: the replicas the controller's sources add besides the YAML ones,
and the drain of every replica that leaves (the YAML's on a reload too).

Sources (one file each): the YAML ``replicas`` (static, the config itself), the
registration API (controller/replica_registration.py: leases renewed by registering
again) and AWS (controller/replica_aws.py: Auto Scaling groups and EC2 tags, polled).
A replica id belongs to one source at a time; the YAML wins over every other.

A replica its source removes is not dropped at once: it stays in the topology with
``draining=True`` (its balancer sends it nothing new, requests in flight on it finish)
until ``membership.drain_grace_s`` has passed or every live balancer of its owning region
(a fleet: each member reports on its own) has reported, at a topology version that already
marks it draining, nothing in flight on it.

State only, no I/O: the controller pushes a new topology whenever a call here says the
membership changed. Not persisted: after a controller restart registered replicas come
back with their next renewal and AWS ones with the first poll.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from controller.core.drain import MemberLoad, drain_end, loads_of
from controller.membership_store import SavedMember
from skymesh.config import MeshConfig
from skymesh.routing.pairing.base import Role

STATIC = "static"
REGISTRATION = "registration"


@dataclass(slots=True)
class Member:
    """One replica a source other than the current YAML contributes (or a YAML replica a
    reload removed, while it drains)."""

    replica_id: str
    url: str
    region: str  # its home region
    source: str  # STATIC, REGISTRATION or an AWS source's name ("aws:<aws region>")
    role: Role = "both"  # its prefill/decode role, as its source names it
    # a registration's lease end (monotonic); None: the source says when it leaves
    expires_at: float | None = None
    draining_since: float | None = None
    # the first topology version that publishes it draining (its balancer's report at
    # this version or later tells whether anything is still in flight on it)
    drain_version: int = 0
    ttl_s: float | None = None  # a registration's lease length

    @property
    def draining(self) -> bool:
        return self.draining_since is not None


@dataclass(frozen=True, slots=True)
class Discovered:
    """A replica a polled source found."""

    replica_id: str
    url: str
    region: str
    role: Role = "both"


class MembershipRefused(Exception):
    """A source's change that cannot be taken: ``status`` is the HTTP answer (403: the id
    belongs to another source; 404: no such registration; 409: a conflict with another
    replica; 429: the table is full)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class MembershipMetrics:
    """``skymesh_membership_*`` on the controller's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.replicas = Gauge("skymesh_membership_replicas",
                              "Replicas in the topology (not draining) by home region and source.",
                              ("region", "source"), registry=registry)
        self.draining = Gauge("skymesh_membership_draining",
                              "Replicas published as draining by home region.", ("region",), registry=registry)
        self.registrations = Counter("skymesh_membership_registrations",
                                     "Registration API calls by result.", ("result",), registry=registry)
        for result in ("registered", "renewed", "deregistered", "rejected", "unauthorized"):
            self.registrations.labels(result)
        self.polls = Counter("skymesh_membership_source_polls", "Polls of discovery sources by source and result.",
                             ("source", "result"), registry=registry)
        self.drained = Counter("skymesh_membership_drained",
                               "Replicas dropped after draining, by why (idle: their balancer reported nothing "
                               "in flight; grace: drain_grace_s passed).", ("reason",), registry=registry)
        for reason in ("idle", "grace"):
            self.drained.labels(reason)


class Membership:
    def __init__(self, cfg: MeshConfig, registry: CollectorRegistry, version: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.metrics = MembershipMetrics(registry)
        self._version = version
        self._clock = clock
        self.members: dict[str, Member] = {}
        self._static = _static_urls(cfg)
        self.sources: set[str] = {STATIC, REGISTRATION} | {aws_source_name(s.aws_region) for s in cfg.membership.aws}
        self.update_metrics()

    # ------------------------------------------------------------------ queries

    def static_urls(self) -> dict[str, str]:
        """replica id -> URL of the current YAML's replicas."""
        return self._static

    def registered_count(self) -> int:
        return sum(1 for m in self.members.values() if m.source == REGISTRATION and not m.draining)

    def url_index(self) -> dict[str, str]:
        """url -> the replica id at it (the YAML's first, then the members)."""
        index = {m.url: m.replica_id for m in self.members.values()}
        index.update({u: rid for rid, u in self.static_urls().items()})
        return index

    def of_region(self, region: str) -> list[Member]:
        return sorted((m for m in self.members.values() if m.region == region), key=lambda m: m.replica_id)

    # ------------------------------------------------------------------ changes

    def _check_free(self, replica_id: str, url: str, region: str, source: str,
                    urls: dict[str, str] | None = None) -> Member | None:
        """The member ``replica_id`` already is (of ``source``), or None; refuses an id of
        the YAML or of another source, another region, or a URL another replica has."""
        if replica_id in self.static_urls():
            raise MembershipRefused(403, f"replica {replica_id!r} is configured in the YAML", "replica_id")
        prev = self.members.get(replica_id)
        if prev is not None and prev.source != source:
            raise MembershipRefused(403, f"replica {replica_id!r} belongs to source {prev.source}", "replica_id")
        if prev is not None and prev.region != region:
            raise MembershipRefused(409, f"replica {replica_id!r} is a replica of {prev.region}; "
                                         "deregister it there first", "region")
        user = (urls if urls is not None else self.url_index()).get(url)
        if user is not None and user != replica_id:
            raise MembershipRefused(409, f"{url} is already replica {user!r}", "url")
        return prev

    def register(self, replica_id: str, url: str, region: str, ttl_s: float,
                 role: Role = "both") -> tuple[bool, bool]:
        """Register or renew a lease: (new to the topology or changed, renewal). Raises
        :class:`MembershipRefused`."""
        prev = self._check_free(replica_id, url, region, REGISTRATION)
        expires = self._clock() + ttl_s
        if prev is None:
            if self.registered_count() >= self.cfg.membership.registration.max_replicas:
                raise MembershipRefused(429, "the registration table is full "
                                             f"({self.cfg.membership.registration.max_replicas} replicas)")
            self.members[replica_id] = Member(replica_id, url, region, REGISTRATION, role, expires_at=expires,
                                              ttl_s=ttl_s)
            self.update_metrics()
            return True, False
        changed = prev.draining or prev.url != url or prev.role != role
        prev.url = url
        prev.role = role
        prev.expires_at = expires
        prev.ttl_s = ttl_s
        prev.draining_since = None
        if changed:
            self.update_metrics()
        return changed, not changed

    def deregister(self, replica_id: str) -> bool:
        """Drain a registered replica: True when that changed the topology. Raises
        :class:`MembershipRefused` (404: not registered; 403: another source's)."""
        if replica_id in self.static_urls():
            raise MembershipRefused(403, f"replica {replica_id!r} is configured in the YAML", "replica_id")
        m = self.members.get(replica_id)
        if m is None:
            raise MembershipRefused(404, f"no registered replica {replica_id!r}", "replica_id")
        if m.source != REGISTRATION:
            raise MembershipRefused(403, f"replica {replica_id!r} belongs to source {m.source}", "replica_id")
        if m.draining:
            return False
        self._leave(m)
        return True

    def replace_source(self, source: str, found: Iterable[Discovered]) -> tuple[bool, list[str]]:
        """A polled source's whole current set: new ones join, missing ones drain.
        (changed, the ids refused: another source's, or a URL already used)."""
        changed = False
        refused: list[str] = []
        seen: set[str] = set()
        urls = self.url_index()  # one index for the whole list (a large group stays linear)
        for d in found:
            if d.replica_id in seen:
                continue
            try:
                prev = self._check_free(d.replica_id, d.url, d.region, source, urls)
            except MembershipRefused:
                refused.append(d.replica_id)
                continue
            seen.add(d.replica_id)
            if prev is not None:
                urls.pop(prev.url, None)
            urls[d.url] = d.replica_id
            if prev is None:
                self.members[d.replica_id] = Member(d.replica_id, d.url, d.region, source, d.role)
                changed = True
            elif prev.draining or prev.url != d.url or prev.role != d.role:
                prev.url = d.url
                prev.role = d.role
                prev.draining_since = None
                changed = True
        for m in list(self.members.values()):
            if m.source == source and m.replica_id not in seen and not m.draining:
                self._leave(m)
                changed = True
        if changed:
            self.update_metrics()
        return changed, refused

    def config_changed(self, old: MeshConfig, new: MeshConfig) -> None:
        """A reload: YAML replicas it removed drain (as YAML members); ids the new YAML
        configures stop being members (the YAML wins)."""
        self.cfg = new
        self._static = now_static = _static_urls(new)
        for rid in [rid for rid in self.members if rid in now_static]:
            del self.members[rid]
        for r in old.regions:
            for rep in r.replicas:
                if rep.id not in now_static and rep.id not in self.members:
                    m = Member(rep.id, rep.url, r.name, STATIC)
                    self.members[rep.id] = m
                    self._leave(m)
        self.sources = ({STATIC, REGISTRATION} | {aws_source_name(s.aws_region) for s in new.membership.aws}
                        | {m.source for m in self.members.values()})
        self.update_metrics()

    def _leave(self, m: Member) -> None:
        """Start ``m``'s drain (dropped at once with no grace period)."""
        if self.cfg.membership.drain_grace_s <= 0:
            del self.members[m.replica_id]
        else:
            m.draining_since = self._clock()
            m.expires_at = None
            # the next topology built carries it draining; its version is at least this
            m.drain_version = self._version() + 1
        self.update_metrics()

    def sweep(self, owners: Mapping[str, str], loads: Mapping[str, Sequence[MemberLoad | None]]) -> bool:
        """Expired leases start draining; drains end after the grace period or once every
        live balancer of the owning region (``owners``: home region -> owner; ``loads``:
        region -> the load each of its live balancers last reported, None for one that has
        not reported; an admin JSON object in its place is read as one) reported nothing in
        flight on the replica (controller/core/drain.py). True when the topology changed."""
        now = self._clock()
        grace = self.cfg.membership.drain_grace_s
        changed = False
        for m in list(self.members.values()):
            if not m.draining:
                if m.expires_at is not None and now >= m.expires_at:
                    self._leave(m)
                    changed = True
                continue
            assert m.draining_since is not None
            owner_loads = loads_of(loads.get(owners.get(m.region, m.region)))
            reason = drain_end(m.replica_id, m.drain_version, now - m.draining_since, grace, owner_loads)
            if reason is None:
                continue
            del self.members[m.replica_id]
            self.metrics.drained.labels(reason).inc()
            changed = True
        if changed:
            self.update_metrics()
        return changed

    # ------------------------------------------------------------------ persistence

    def saved(self) -> list[SavedMember]:
        """The members as the store keeps them."""
        return [SavedMember(m.replica_id, m.url, m.region, m.source, m.ttl_s, m.draining, m.drain_version, m.role)
                for m in sorted(self.members.values(), key=lambda m: m.replica_id)]

    def restore(self, saved: list[SavedMember]) -> int:
        """Members saved before a restart (controller/membership_store.py says how they
        come back); the number taken."""
        now = self._clock()
        regions = {r.name for r in self.cfg.regions}
        urls = self.url_index()
        taken = 0
        for s in saved:
            if (s.replica_id in self._static or s.replica_id in self.members or s.region not in regions
                    or s.source not in self.sources or s.url in urls or (s.source == STATIC and not s.draining)):
                continue
            m = Member(s.replica_id, s.url, s.region, s.source, s.role, ttl_s=s.ttl_s)
            if s.draining:
                m.draining_since = now
                m.drain_version = s.drain_version
            elif s.source == REGISTRATION:
                m.expires_at = now + (s.ttl_s or self.cfg.membership.registration.default_ttl_s)
            self.members[m.replica_id] = m
            urls[m.url] = m.replica_id
            taken += 1
        self.update_metrics()
        return taken

    # ------------------------------------------------------------------ metrics, status

    def update_metrics(self) -> None:
        self.metrics.replicas.clear()
        self.metrics.draining.clear()
        for r in self.cfg.regions:
            for source in sorted(self.sources):
                self.metrics.replicas.labels(r.name, source).set(0)
            self.metrics.replicas.labels(r.name, STATIC).set(len(r.replicas))
            self.metrics.draining.labels(r.name).set(0)
        for m in self.members.values():
            if m.draining:
                self.metrics.draining.labels(m.region).inc()
            else:
                self.metrics.replicas.labels(m.region, m.source).inc()

    def status_json(self) -> list[dict[str, Any]]:
        now = self._clock()
        return [{
            "replica_id": m.replica_id, "url": m.url, "region": m.region, "source": m.source,
            "draining": m.draining,
            "lease_left_s": None if m.expires_at is None else round(max(0.0, m.expires_at - now), 3),
            "draining_for_s": None if m.draining_since is None else round(now - m.draining_since, 3),
        } for m in sorted(self.members.values(), key=lambda m: m.replica_id)]


def _static_urls(cfg: MeshConfig) -> dict[str, str]:
    return {rep.id: rep.url for r in cfg.regions for rep in r.replicas}


def aws_source_name(aws_region: str) -> str:
    return f"aws:{aws_region}"
