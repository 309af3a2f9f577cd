"""The region's entry follows the controller on AWS (``balancer.entry_target_groups``).

A region's balancers sit behind load balancers whose target groups check each one's
``/health`` on their own (every 10 s, out after 2 failures: ~20 s during which new
connections still reach a frozen balancer). The controller knows sooner (its probes, its
siblings' reports: controller/sibling_watch.py), so it moves the entry itself: a member
whose balancer id is an EC2 instance id (a registered fleet's members are named by theirs)
is deregistered from every one of the region's entry target groups when it goes dead or
draining, and registered again when it is alive (and not draining).

Only transitions cause calls: what was last done for each instance is remembered, and a
call is made only when the wanted state differs. A failed call is logged (at most once a
minute per instance and action), counted and retried on the next round (the controller's
probe interval, or sooner on the next liveness change); it never blocks the controller:
the calls run in a thread of their own loop. At a start nothing is remembered: the first
round registers every live member and deregisters every dead one (both are idempotent).
boto3 is imported only when some region names target groups.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from controller.balancer_members import MemberState
from skymesh.balancer.identity import INSTANCE_ID_RE
from skymesh.config import RegionConfig
from skymesh.runtime.procs import wait_event

log = logging.getLogger("skymesh.controller.entry")

# a failure of one instance's call is logged at most this often (each is counted)
LOG_EVERY_S = 60.0
REGISTER, DEREGISTER = "register", "deregister"


@dataclass(frozen=True, slots=True)
class RegionEntry:
    """One region's entry: its target groups and the Elastic Load Balancing client of its
    AWS region."""

    region: str
    target_groups: tuple[str, ...]
    client: Any  # botocore ELBv2 client


def wanted_targets(members: Mapping[str, Sequence[MemberState]],
                   regions: Iterable[str]) -> dict[tuple[str, str], bool]:
    """(region, instance id) -> whether it belongs in the region's entry (alive and not
    draining), for the members of ``regions`` named by an instance id. One instance under
    two records (a restart) belongs while any of them is alive. A region none of whose
    members is alive is left out (nothing is called for it): the controller losing every
    balancer of a region at once is as likely its own cut-off as theirs, and emptying the
    entry would turn that into an outage; the groups' own health checks decide then, as
    an NLB fails open when no target is healthy."""
    out: dict[tuple[str, str], bool] = {}
    for region in regions:
        if not any(m.alive and not m.draining for m in members.get(region, ())):
            continue
        for m in members.get(region, ()):
            if not INSTANCE_ID_RE.match(m.balancer_id):
                continue
            key = (region, m.balancer_id)
            out[key] = out.get(key, False) or (m.alive and not m.draining)
    return out


class EntryTargets:
    """Keeps each configured region's entry target groups in line with its members."""

    def __init__(self, regions: Sequence[RegionConfig], registry: CollectorRegistry) -> None:
        import boto3
        from botocore.config import Config

        # a round is retried by the next: few retries, bounded waits (a hung call holds
        # only this loop's thread)
        config = Config(retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=5, read_timeout=10)
        self.entries: dict[str, RegionEntry] = {}
        for r in regions:
            if not r.balancer.entry_target_groups:
                continue
            kwargs: dict[str, Any] = {"region_name": r.aws_region, "config": config}
            if r.balancer.entry_endpoint_url is not None:
                kwargs["endpoint_url"] = r.balancer.entry_endpoint_url
            self.entries[r.name] = RegionEntry(r.name, r.balancer.entry_target_groups,
                                               boto3.client("elbv2", **kwargs))
        # (region, instance id) -> True: registered in every group, False: deregistered
        # from every group (as last done, successfully)
        self.done: dict[tuple[str, str], bool] = {}
        self.calls = Counter("skymesh_controller_entry_target_calls",
                             "Calls to the regions' entry target groups by action and result.",
                             ("action", "result"), registry=registry)
        for action in (REGISTER, DEREGISTER):
            for result in ("ok", "error"):
                self.calls.labels(action, result)
        self._wake = asyncio.Event()
        self._logged_at: dict[tuple[str, str, str], float] = {}

    @staticmethod
    def configured(regions: Iterable[RegionConfig]) -> bool:
        return any(r.balancer.entry_target_groups for r in regions)

    def poke(self) -> None:
        """A member's liveness changed: sync now rather than at the next round."""
        self._wake.set()

    async def run(self, members: Mapping[str, Sequence[MemberState]], interval_s: Callable[[], float]) -> None:
        """The loop: a round on every poke and every ``interval_s()`` seconds."""
        while True:
            await wait_event(self._wake, interval_s())
            self._wake.clear()
            await self.sync(members)

    async def sync(self, members: Mapping[str, Sequence[MemberState]]) -> None:
        """One round: a call for every instance whose wanted state differs from what was
        last done; failures stay to be retried by the next round."""
        wanted = wanted_targets(members, self.entries)
        for key in [k for k in self.done if k not in wanted]:
            del self.done[key]  # a member forgotten by the controller
        for (region, instance_id), belongs in sorted(wanted.items()):
            if self.done.get((region, instance_id)) == belongs:
                continue
            if await self._apply(self.entries[region], instance_id, belongs):
                self.done[(region, instance_id)] = belongs

    async def _apply(self, entry: RegionEntry, instance_id: str, belongs: bool) -> bool:
        action = REGISTER if belongs else DEREGISTER
        call = entry.client.register_targets if belongs else entry.client.deregister_targets
        ok = True
        for group in entry.target_groups:
            try:
                await asyncio.to_thread(call, TargetGroupArn=group, Targets=[{"Id": instance_id}])
            except Exception as e:  # an AWS outage must never stop the controller: retried
                ok = False
                self.calls.labels(action, "error").inc()
                self._warn(entry.region, instance_id, action, group, e)
            else:
                self.calls.labels(action, "ok").inc()
        if ok:
            log.info("entry target groups updated", extra={"region": entry.region, "instance": instance_id,
                                                           "action": action, "groups": len(entry.target_groups)})
        return ok

    def _warn(self, region: str, instance_id: str, action: str, group: str, error: Exception) -> None:
        now = time.monotonic()
        key = (region, instance_id, action)
        last = self._logged_at.get(key)
        if last is not None and now - last < LOG_EVERY_S:
            return
        self._logged_at[key] = now
        if len(self._logged_at) > 4096:  # bounded: drop the oldest half
            for k in sorted(self._logged_at, key=self._logged_at.__getitem__)[:2048]:
                del self._logged_at[k]
        log.warning("entry target group call failed; retried next round",
                    extra={"region": region, "instance": instance_id, "action": action, "target_group": group,
                           "error": repr(error)[:300]})
