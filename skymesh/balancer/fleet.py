"""This balancer's place in its region's fleet: the sibling balancers it knows (listed in
the config, or told by the controller's topology) and, once it knows one, the region
core's sibling state (push-budget units, placements; skymesh/routing/siblings.py).

A balancer whose region lists no siblings and whose controller names none is a region of
one: nothing here touches its region core."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from skymesh.routing.assembly import SiblingSettings, build_siblings
from skymesh.routing.region import RegionCore
from skymesh.routing.siblings import SiblingMessage


class RegionFleet:
    def __init__(self, region: str, balancer_id: str, epoch: int, core: RegionCore, *,
                 static_members: Mapping[str, str], settings: SiblingSettings) -> None:
        self.region = region
        self.balancer_id = balancer_id
        self.epoch = epoch
        self.core = core
        self.settings = settings
        # sibling id -> its own gRPC address, from the config and from the controller
        self.static = {sid: addr for sid, addr in static_members.items() if sid != balancer_id}
        self.from_topology: dict[str, str] = {}
        self.topology_known = False
        self.listed_alive = True
        # the topology's view of every member of the region (for /admin/status)
        self.members: list[dict[str, Any]] = []

    def addresses(self) -> dict[str, str]:
        return {**self.static, **self.from_topology}

    def has_siblings(self) -> bool:
        return bool(self.static or self.from_topology)

    def topology_members(self, members: Iterable[Any], now: float) -> None:
        """The controller's list of the region's balancers (BalancerMember messages):
        the live ones other than this one are siblings."""
        members = list(members)
        self.members = [
            {"balancer_id": m.balancer_id, "alive": m.alive, "epoch": m.epoch, "http_url": m.http_url,
             "grpc_address": m.grpc_address}
            for m in members if m.balancer_id != self.balancer_id]
        self.from_topology = {m["balancer_id"]: m["grpc_address"] for m in self.members
                              if m["alive"] and m["grpc_address"]}
        # listed dead (the controller lost it: a stall, a cut): nobody's home until listed
        # alive again; not listed yet (its registration is on the way): a member
        self.listed_alive = all(m.alive for m in members if m.balancer_id == self.balancer_id)
        self.topology_known = True
        self.attach_if_needed(now)
        if self.core.siblings is not None:
            self.core.siblings.shares.topology_heard()

    def attach_if_needed(self, now: float) -> None:
        """From the first sibling on, the region core shares push budgets (it holds no
        unit until it heard its siblings or ``dead_after_s`` passed)."""
        if self.core.siblings is None and self.has_siblings():
            self.core.attach_siblings(build_siblings(self.region, self.balancer_id,
                                                     self.core.settings.dispatch_budget, self.settings,
                                                     epoch=self.epoch, started_at=now))
        if self.core.siblings is not None:
            # the push budget's homes: the topology's live members once it spoke (a member
            # it calls dead keeps its units until then), else the config's
            self.core.siblings.expect(self.from_topology if self.topology_known else self.static,
                                      self_listed=self.listed_alive)

    def message(self, now: float) -> SiblingMessage:
        return self.core.sibling_message(now)

    def apply(self, msg: SiblingMessage, now: float) -> bool:
        if self.core.siblings is None:
            return False
        return self.core.sibling_state(msg, now)

    def units_grew(self) -> bool:
        """The last sibling step gave this balancer more usable units (a dispatch round
        may place more)."""
        return self.core.siblings is not None and self.core.siblings.units_grew

    def status(self) -> dict[str, Any]:
        sib = self.core.siblings
        out: dict[str, Any] = {"known": sorted(self.addresses()), "members": self.members}
        if sib is not None:
            now_units = {r: sib.shares.units_on(r) for r in self.core.replicas}
            out.update(units_held=now_units, messages_in=sib.messages_in,
                       placements_applied=sib.placements_applied)
        return out
