"""When a region is alive (in DNS, owning its replicas) and when it is out.

A region is alive while any of its balancers is; it dies with the last and recovers with
the first. A registered fleet none of whose balancers is known yet (a first start) is
presumed alive for as long as a listed balancer would be: until its first balancers had
time to register (probe rounds to the failure threshold, plus a report's staleness). A
dead region's replicas are adopted by the nearest live region (controller/topology.py)
and DNS stops answering with it; both come back with the region.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlparse

from controller.balancer_members import UNPROBED_REPORT_STALE_S, MemberState
from controller.core.region_state import Now, RegionState
from controller.topology import assign_owners
from skymesh.config import MeshConfig
from skymesh.dns.base import BalancerEndpoint


def presumed_alive_until(cfg: MeshConfig, now: Now) -> float:
    """The monotonic instant until which a registered fleet with no member known yet is
    presumed alive."""
    return now.monotonic_s + (cfg.controller.failure_threshold * cfg.controller.probe_interval_s
                              + UNPROBED_REPORT_STALE_S)


def refresh_region(state: RegionState, now: Now) -> bool:
    """The region's record from its members: alive while any is, draining when all are,
    named by its latest registration, last seen when its latest member was. True when
    that changed whether the region is alive."""
    rec = state.record
    was_alive = rec.alive
    members = state.members
    if members:
        rec.alive = any(m.alive for m in members)
        rec.draining = all(m.draining for m in members)
    else:  # a registered fleet none of whose balancers registered yet
        rec.alive = now.monotonic_s < state.presumed_alive_until_s
        rec.draining = False
    latest = state.member(state.latest_member) if state.latest_member is not None else None
    if latest is not None:
        rec.balancer_id, rec.epoch = latest.balancer_id, latest.epoch
    seen = [m.last_seen_ms for m in members if m.last_seen_ms is not None]
    if seen:
        rec.last_seen_ms = max(seen)
    return rec.alive != was_alive


def alive_regions(regions: Mapping[str, RegionState]) -> set[str]:
    return {name for name, s in regions.items() if s.record.alive}


def owners(cfg: MeshConfig, regions: Mapping[str, RegionState]) -> dict[str, str]:
    """replica id -> the region that owns it now (its home while alive, else the nearest
    live region)."""
    return assign_owners(cfg, alive_regions(regions))


def recovered_owners(cfg: MeshConfig, saved: Mapping[str, str], regions: Mapping[str, RegionState]) -> dict[str, str]:
    """The ownership saved before a restart (an adoption in force) when it covers exactly
    the config's replicas, else the ownership the regions' liveness gives."""
    known = {rep.id for r in cfg.regions for rep in r.replicas}
    if saved and set(saved) == known:
        return dict(saved)
    return owners(cfg, regions)


def member_change_reason(region: str, member: MemberState, alive: bool, reason: str, region_changed: bool) -> str:
    """Why the topology changed when one balancer of ``region`` came or went: the region's
    own failover or recovery, or only its member list (siblings learn it from the push)."""
    verb = "recovered" if alive else "dead"
    if region_changed:
        return f"{region} {verb}: {reason}"
    return f"{region} balancer {member.name} {verb}: {reason}"


def emptied_reason(state: RegionState) -> str:
    """Why a region's liveness changed with no balancer's own change: the presumption of
    a registered fleet ran out, or its departed balancers were forgotten."""
    verb = "alive" if state.record.alive else "dead"
    return f"{state.name} {verb}: {'no balancer registered' if not state.members else 'its balancers left'}"


def endpoints(cfg: MeshConfig, regions: Mapping[str, RegionState]) -> list[BalancerEndpoint]:
    """One DNS endpoint per region of the config: healthy while the region is alive."""
    out = []
    for r in cfg.regions:
        rec = regions[r.name].record
        u = urlparse(rec.http_url)
        out.append(BalancerEndpoint(
            region=r.name, balancer_id=rec.balancer_id or r.name,
            ip=r.balancer.public_ip or u.hostname or "",
            port=u.port or 80, healthy=rec.alive, aws_region=r.aws_region,
        ))
    return out
