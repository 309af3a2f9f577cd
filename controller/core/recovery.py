"""A region as the controller starts with it: the config's balancers, those that
registered without being in the config, and what the state file kept of each."""

from __future__ import annotations

from collections.abc import Mapping

from controller.balancer_members import MemberState, configured_members
from controller.core.region_state import RegionRecord, RegionState, StoredBalancer, StoredRegion
from skymesh.config import RegionConfig


def recovered_members(region: RegionConfig, stored_region: StoredRegion | None,
                      stored: Mapping[str, StoredBalancer]) -> list[MemberState]:
    """The region's configured members plus those that registered without being in the
    config, with what the state file kept of each (epochs never repeat)."""
    members = configured_members(region)
    known = {m.key for m in members}
    for key, rec in stored.items():
        if key not in known:
            members.append(MemberState(key=key, configured=False, http_url=rec.http_url or "",
                                       grpc_address=rec.grpc_address or "", probe_url=""))
    for m in members:
        rec = stored.get(m.key)
        if rec is not None:
            m.balancer_id = rec.balancer_id or ""
            m.epoch = rec.epoch or 0
            m.instance_epoch = rec.instance_epoch or 0
            # a balancer not known to be dead is presumed alive until probes say so
            m.alive = rec.alive
            m.draining = rec.draining
            m.last_seen_ms = rec.last_seen_ms
    if len(members) == 1 and members[0].configured and not stored and stored_region is not None:
        # a state file from before fleets: the region's record was its one balancer's
        m = members[0]
        m.balancer_id = stored_region.balancer_id or ""
        m.epoch = stored_region.epoch or 0
        m.alive = stored_region.alive
        m.last_seen_ms = stored_region.last_seen_ms
    return members


def recovered_region(region: RegionConfig, stored_region: StoredRegion | None,
                     stored: Mapping[str, StoredBalancer], presumed_alive_until_s: float) -> RegionState:
    """The region's state at a start (its record is derived from its members next:
    controller.core.failover.refresh_region)."""
    members = recovered_members(region, stored_region, stored)
    record = RegionRecord(
        balancer_id=(stored_region.balancer_id if stored_region else None) or "",
        epoch=(stored_region.epoch if stored_region else None) or 0,
        alive=True,
        http_url=region.balancer.advertise_url,
        grpc_address=str(region.balancer.grpc_advertise),
        last_seen_ms=stored_region.last_seen_ms if stored_region else None,
    )
    latest = max(members, key=lambda m: m.epoch, default=None)
    return RegionState(name=region.name, record=record, members=members,
                       presumed_alive_until_s=presumed_alive_until_s,
                       latest_member=latest.key if latest is not None and latest.epoch else None)
