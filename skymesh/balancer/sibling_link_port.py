"""What the sibling channel (:class:`~skymesh.balancer.sibling_link.SiblingLink`) may ask
of the balancer: :class:`SiblingLinkPort` implements
:class:`~skymesh.balancer.ports.SiblingLinkBalancer` over the region's fleet
(:class:`~skymesh.balancer.fleet.RegionFleet`), the client gate (key usage shared
region-wide), the probe owners and the replica pages scraped here. The balancer
(server.py) builds it and hands it to the mesh services."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping

from skymesh.balancer.fleet import RegionFleet
from skymesh.balancer.gate import ClientGate
from skymesh.balancer.membership import ReplicaInfo
from skymesh.balancer.mesh_member import MeshMemberPort
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.prober import ProbeResult, SharedPage
from skymesh.config import MeshConfig
from skymesh.routing.probe_owners import ProbeOwners
from skymesh.routing.siblings import SiblingMessage
from skymesh.runtime.clock import loop_clock


class SiblingLinkPort(MeshMemberPort):
    """The region's other balancers as the sibling channel sees them, and the replica
    pages that go to them (the probe loop queues them with :meth:`share_pages`)."""

    def __init__(self, config: Callable[[], MeshConfig], region: str, balancer_id: str, epoch: int, *,
                 fleet: RegionFleet, gate: ClientGate, probe_owners: ProbeOwners, metrics: BalancerMetrics,
                 wake: asyncio.Event, replicas: Callable[[], Mapping[str, ReplicaInfo]],
                 apply_probe: Callable[[ReplicaInfo, ProbeResult], None],
                 on_dispatch_round: Callable[[Callable[[], None]], None]) -> None:
        """``replicas``: the replicas the balancer owns now; ``apply_probe``: takes a
        sibling's page as a probe of this balancer's own; ``on_dispatch_round``: adds a
        listener the balancer calls after every dispatch round."""
        super().__init__(config, region, balancer_id, epoch)
        self.fleet = fleet
        self.gate = gate
        self.probe_owners = probe_owners
        self.metrics = metrics
        self.wake = wake
        self._replicas = replicas
        self._apply_probe = apply_probe
        self._on_dispatch_round = on_dispatch_round
        # pages scraped here since the last sibling message (they go with the next one)
        self._pages_out: list[SharedPage] = []

    def share_pages(self, pages: list[SharedPage], keep: int) -> None:
        """Pages the probe loop scraped go with the next sibling message; past four times
        ``keep`` (the replicas owned) waiting, no sibling channel took them: the newest
        ``keep`` stay."""
        self._pages_out.extend(pages)
        if len(self._pages_out) > 4 * max(1, keep):
            del self._pages_out[: -keep]

    def has_siblings(self) -> bool:
        return self.fleet.has_siblings()

    def sibling_addresses(self) -> dict[str, str]:
        return self.fleet.addresses()

    def expects_siblings(self) -> bool:
        return self.fleet.has_siblings() or self._config().region(self.region).balancer.fleet == "registered"

    def sibling_message(self) -> SiblingMessage:
        # what each client key took here goes along: its limits hold region-wide
        return dataclasses.replace(self.fleet.message(loop_clock()), key_usage=self.gate.take_usage())

    def sibling_refusal(self, balancer_id: str, epoch: int) -> str | None:
        return self.fleet.refusal(balancer_id, epoch)

    def apply_sibling_message(self, msg: SiblingMessage) -> bool:
        applied = self.fleet.apply(msg, loop_clock())
        if applied:
            self.gate.charge_siblings(msg.key_usage)
            if self.fleet.units_grew():
                self.wake.set()  # units came: a dispatch round
        return applied

    def take_shared_pages(self) -> list[SharedPage]:
        pages, self._pages_out = self._pages_out, []
        return pages

    def apply_shared_pages(self, pages: list[SharedPage]) -> None:
        applied = 0
        for rid, res in pages:
            info = self._replicas().get(rid)
            if info is not None and res.sent_at is not None and self.probe_owners.take_page(rid, res.sent_at):
                self._apply_probe(info, res)
                applied += 1
        if applied:
            self.metrics.replica_pages.labels("sibling").inc(applied)
            self.wake.set()

    def sibling_interval_s(self) -> float:
        return self._config().siblings.interval_s

    def sibling_keepalive_s(self) -> float:
        return self._config().siblings.keepalive_s

    def sibling_page_wait_s(self) -> float:
        cfg = self._config()
        return min(cfg.siblings.keepalive_s, cfg.policy.probe_interval_s / 2)

    def on_dispatch_round(self, listener: Callable[[], None]) -> None:
        self._on_dispatch_round(listener)
