"""This balancer's place in its region's fleet: the sibling balancers it knows (listed in
the config, or told by the controller's topology) and, once it knows one, the region
core's sibling state (push-budget units, placements; skymesh/routing/siblings.py).

Who may speak as a sibling comes from the controller's topology once one arrived (else
from the config's list): a message claiming an id the topology does not list, or an epoch
other than the one that member registered with (``instance_epoch``), is refused before it
reaches the region core, whose (epoch, seq) order would otherwise let one forged message
from the future silence the real sibling until a restart. A wildcard address (0.0.0.0,
::) is never a sibling's address: it would dial this balancer itself.

A balancer whose region lists no siblings and whose controller names none is a region of
one: nothing here touches its region core."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from skymesh.balancer.identity import is_wildcard
from skymesh.routing.assembly import SiblingSettings, build_siblings
from skymesh.routing.region import RegionCore
from skymesh.routing.siblings import SiblingMessage
from skymesh.runtime.clock import loop_clock


def _dialable(address: str) -> bool:
    host = address.rsplit(":", 1)[0] if ":" in address else ""
    return bool(address) and not is_wildcard(host)


@dataclass(frozen=True, slots=True)
class TopologyMember:
    """One sibling as the controller's topology lists it."""

    balancer_id: str
    alive: bool
    epoch: int  # the controller's, of its registration
    instance_epoch: int  # its own (its sibling messages carry it; 0: not registered)
    http_url: str
    grpc_address: str

    def as_json(self) -> dict[str, Any]:
        return {"balancer_id": self.balancer_id, "alive": self.alive, "epoch": self.epoch,
                "instance_epoch": self.instance_epoch, "http_url": self.http_url,
                "grpc_address": self.grpc_address}


class RegionFleet:
    def __init__(self, region: str, balancer_id: str, epoch: int, core: RegionCore, *,
                 static_members: Mapping[str, str], settings: SiblingSettings,
                 clock: Callable[[], float] = loop_clock) -> None:
        self.region = region
        self.clock = clock
        self.balancer_id = balancer_id
        self.epoch = epoch
        self.core = core
        self.settings = settings
        self.dead_after_s = settings.dead_after_s
        # sibling id -> its own gRPC address, from the config and from the controller
        # (never a wildcard: that would dial this balancer itself)
        self.static = {sid: addr for sid, addr in static_members.items()
                       if sid != balancer_id and _dialable(addr)}
        self.static_ids = frozenset(sid for sid in static_members if sid != balancer_id)
        self.from_topology: dict[str, str] = {}
        # the topology's view of every other member of the region (None: no topology yet)
        self.topology: dict[str, TopologyMember] | None = None
        # sibling id -> when a message of it was last applied / it was first listed alive
        self.heard_at: dict[str, float] = {}
        self.listed_alive_since: dict[str, float] = {}
        # the topology lists this balancer alive (or not yet at all)
        self.listed_alive = True

    @property
    def members(self) -> list[dict[str, Any]]:
        """The topology's view of the region's other balancers (for /admin/status)."""
        return [m.as_json() for m in (self.topology or {}).values()]

    def addresses(self) -> dict[str, str]:
        """Sibling id -> its own gRPC address: the config's, the topology's live members,
        and a member the topology took out (deregistered to drain) while it still speaks:
        its stream stays up until it has handed its units off."""
        now = self.clock()
        lingering = {sid: m.grpc_address for sid, m in (self.topology or {}).items()
                     if not m.alive and _dialable(m.grpc_address)
                     and now - self.heard_at.get(sid, float("-inf")) <= self.dead_after_s}
        return {**self.static, **lingering, **self.from_topology}

    def has_siblings(self) -> bool:
        return bool(self.static or self.from_topology)

    def topology_members(self, members: Iterable[Any], now: float) -> None:
        """The controller's list of the region's balancers (BalancerMember messages):
        the live ones other than this one, at a dialable address, are siblings."""
        members = list(members)
        # listed dead (the controller lost it: a stall, a cut): nobody's home until listed
        # alive again; not listed yet (its registration is on the way): a member
        self.listed_alive = all(m.alive for m in members if m.balancer_id == self.balancer_id)
        listed = {m.balancer_id: TopologyMember(
            balancer_id=m.balancer_id, alive=m.alive, epoch=m.epoch,
            instance_epoch=getattr(m, "instance_epoch", 0), http_url=m.http_url, grpc_address=m.grpc_address)
            for m in members if m.balancer_id != self.balancer_id}
        self.topology = listed
        self.from_topology = {sid: m.grpc_address for sid, m in listed.items()
                              if m.alive and _dialable(m.grpc_address)}
        for sid in list(self.listed_alive_since):
            if sid not in self.from_topology:
                del self.listed_alive_since[sid]
        for sid in self.from_topology:
            self.listed_alive_since.setdefault(sid, now)
        self.attach_if_needed(now)
        if self.core.siblings is not None:
            self.core.siblings.shares.topology_heard()

    def attach_if_needed(self, now: float) -> None:
        """From the first sibling on, the region core shares push budgets (it holds no
        unit until it heard its siblings or a lease and the skew margin passed)."""
        if self.core.siblings is None and self.has_siblings():
            self.core.attach_siblings(build_siblings(self.region, self.balancer_id,
                                                     self.core.settings.dispatch_budget, self.settings,
                                                     epoch=self.epoch, started_at=now))
        if self.core.siblings is not None:
            self.core.siblings.expect(self.member_ids(), self_listed=self.listed_alive)

    def member_ids(self) -> list[str]:
        """The region's other members, heard from or not: the topology's live ones once it
        spoke (a member it calls dead keeps its units until then), else the config's. The
        push budget's homes and the probe owners (skymesh/routing/probe_owners.py) are
        chosen among them and this balancer."""
        return list(self.from_topology if self.topology is not None else self.static)

    def refusal(self, balancer_id: str, epoch: int) -> str | None:
        """Why a sibling message claiming ``balancer_id`` at ``epoch`` is refused; None when
        it may reach the region core. With a topology: the id must be a member it lists,
        registered (its instance epoch known) with exactly this epoch; without one, an id the
        config lists."""
        if balancer_id == self.balancer_id:
            return "not_a_sibling"
        if self.topology is not None:
            m = self.topology.get(balancer_id)
            if m is None:
                return "unknown_sibling"
            if not m.instance_epoch:
                return "unregistered_sibling"
            if epoch != m.instance_epoch:
                return "wrong_epoch"
            return None
        if balancer_id not in self.static_ids:
            return "unknown_sibling"
        return None

    def message(self, now: float) -> SiblingMessage:
        return self.core.sibling_message(now)

    def apply(self, msg: SiblingMessage, now: float) -> bool:
        if self.core.siblings is None:
            return False
        if self.refusal(msg.shares.balancer_id, msg.shares.epoch) is not None:
            return False
        applied = self.core.sibling_state(msg, now)
        if applied:
            self.heard_at[msg.shares.balancer_id] = now
        return applied

    def units_grew(self) -> bool:
        """The last sibling step gave this balancer more usable units (a dispatch round
        may place more)."""
        return self.core.siblings is not None and self.core.siblings.units_grew

    def unresponsive(self, now: float) -> list[str]:
        """Siblings the topology lists alive that no message has come from for twice the
        dead-after time (since they were listed, or last heard): what the reports name."""
        quiet_s = 2 * self.dead_after_s
        return sorted(sid for sid, since in self.listed_alive_since.items()
                      if now - max(since, self.heard_at.get(sid, since)) > quiet_s)

    # ------------------------------------------------------------------ a member leaving

    def start_draining(self) -> bool:
        """This balancer leaves: its push-budget units go to the siblings (the shares stop
        holding and wanting units; the next message says so). False: no siblings, nothing
        to hand off."""
        sib = self.core.siblings
        if sib is None:
            return False
        sib.shares.draining = True
        return True

    def units_held(self) -> int:
        """Push-budget units this balancer still holds over all replicas, its home units
        not given up yet and its leases (0 without siblings): a leaving member waits until
        none is left, so its siblings take them on its word, not on its silence."""
        sib = self.core.siblings
        if sib is None:
            return 0
        return len(sib.shares.home_held) + len(sib.shares.leases)

    def status(self) -> dict[str, Any]:
        sib = self.core.siblings
        now = self.clock()
        out: dict[str, Any] = {"known": sorted(self.addresses()), "members": self.members,
                               "last_heard_s": {sid: round(now - t, 3) for sid, t in sorted(self.heard_at.items())},
                               "unresponsive": self.unresponsive(now)}
        if sib is not None:
            now_units = {r: sib.shares.units_on(r) for r in self.core.view.replicas}
            out.update(units_held=now_units, messages_in=sib.messages_in,
                       placements_applied=sib.placements_applied, draining=sib.shares.draining)
        return out
