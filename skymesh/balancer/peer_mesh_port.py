"""What the heartbeat mesh (:class:`~skymesh.balancer.services.PeerMesh`) may ask of the
balancer, and the trust it keeps about peer regions: :class:`PeerMeshPort` implements
:class:`~skymesh.balancer.ports.PeerMeshBalancer` over the region core, the peer
balancers (membership.PeerInfo) and the config, and holds which origins a forward from
each peer may claim and the forwards refused by mesh identity. The balancer (server.py)
builds it and hands it to the mesh services."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from skymesh.balancer.membership import PeerInfo
from skymesh.balancer.mesh_member import MeshMemberPort
from skymesh.balancer.services import rejected_peer_calls
from skymesh.config import HostPort, MeshConfig
from skymesh.routing.heartbeat import HeartbeatSnapshot
from skymesh.routing.region import RegionCore
from skymesh.routing.region_actions import Action
from skymesh.runtime.clock import loop_clock

log = logging.getLogger("skymesh.balancer")


class PeerMeshPort(MeshMemberPort):
    """The peer regions' balancers as the heartbeat mesh sees them: where they answer,
    what this region tells them, what their heartbeats and deaths change here."""

    def __init__(self, config: Callable[[], MeshConfig], region: str, balancer_id: str, epoch: int, *,
                 core: RegionCore, peers: Mapping[str, PeerInfo], wake: asyncio.Event,
                 apply: Callable[[list[Action]], None], services: Sequence[Any]) -> None:
        """``apply``: carries out the core's actions (the balancer's request flow);
        ``services``: the balancer's mesh services (redialled when a peer is back, and
        their refusals counted)."""
        super().__init__(config, region, balancer_id, epoch)
        self.core = core
        self.peers = peers
        self.wake = wake
        self._apply = apply
        self._services = services
        # peer region -> the other regions whose replicas the controller gave it (failover):
        # origins a forward from it may claim besides its own (the topology sets it)
        self.peer_adoptions: dict[str, frozenset[str]] = {}
        # forwards refused by mesh identity, by reason (skymesh_rejected_peer_calls)
        self.refused_forwards: dict[str, int] = {}

    def heartbeat_interval_s(self) -> float:
        return self._config().offload.heartbeat_interval_s

    def probe_interval_s(self) -> float:
        return self._config().policy.probe_interval_s

    def offload_enabled(self) -> bool:
        return self._config().offload.enabled

    def grpc_listen(self) -> HostPort:
        return self._config().region(self.region).balancer.grpc_listen

    def peer_regions(self) -> Collection[str]:
        return self.peers.keys()

    def peer_grpc_address(self, region: str) -> str | None:
        peer = self.peers.get(region)
        return None if peer is None else peer.grpc_address

    def heartbeat_snapshot(self, now: float) -> HeartbeatSnapshot:
        return self.core.view.heartbeat(now)

    def availability(self) -> tuple[int, int]:
        return self.core.view.available_for_new_requests(), self.core.view.queue_length

    def offload_counts(self) -> tuple[int, int]:
        return self.core.offloaded_out, self.core.offloaded_in

    def heartbeat_delay_s(self, region: str) -> float:
        cfg = self._config()
        if not cfg.emulate_latency:
            return 0.0
        # gRPC cannot bind a source address, so the delay proxies cannot tell which
        # region a heartbeat stream comes from; apply the link's one-way latency here.
        return max(0.0, (cfg.one_way_ms(region, self.region) - cfg.local_latency_ms) / 1000)

    def apply_peer_heartbeat(self, region: str, snapshot: HeartbeatSnapshot, now: float, *,
                             balancer_id: str, epoch: int, seq: int) -> None:
        self.core.peer_heartbeat(region, snapshot, now, balancer_id=balancer_id, epoch=epoch, seq=seq)
        if self.core.view.queue_length:
            self.wake.set()  # queued requests may now be offloaded

    def peer_down(self, region: str, why: str, *, cut_forwards: bool = True) -> None:
        """A peer region is dead (its heartbeat stream broke, or the controller says its
        balancer is): what waited for it is decided again now (``RegionCore.peer_down``);
        with ``cut_forwards`` its forwards that returned nothing yet are cut too. Heartbeat
        timeouts reach the core through the dispatch loop's ticks."""
        actions = self.core.peer_down(region, loop_clock(), cut_forwards=cut_forwards)
        if actions:
            log.info("peer region down: its requests decided again",
                     extra={"peer": region, "why": why, "requests": len({a.request_id for a in actions})})
        self._apply(actions)
        self.wake.set()

    def peer_back(self, region: str, replicas: int, why: str) -> None:
        """The controller says a peer region's balancer is back, owning ``replicas``:
        re-dial its heartbeat stream now (not at the end of the dial loop's backoff), and
        until its first heartbeat let the requests only it may serve wait for it
        (``RegionCore.peer_returning``) rather than be refused while their region is
        between owners."""
        waiting = self.core.peer_returning(region, loop_clock(), replicas)
        for svc in self._services:
            redial = getattr(svc, "redial", None)
            if redial is not None:
                redial(region)
        log.info("peer region back", extra={"peer": region, "why": why, "replicas": replicas,
                                            "awaiting_heartbeat": waiting})
        self.wake.set()

    def set_adoptions(self, peer_region: str, origins: frozenset[str]) -> None:
        """The regions whose replicas the controller gave ``peer_region`` besides its own."""
        self.peer_adoptions[peer_region] = origins

    def allowed_origins(self, peer_region: str) -> frozenset[str]:
        """The origin regions a forward from ``peer_region``'s balancer may claim: its own,
        and those whose replicas the controller gave it."""
        return frozenset((peer_region,)) | self.peer_adoptions.get(peer_region, frozenset())

    def count_refused_forward(self, reason: str) -> None:
        self.refused_forwards[reason] = self.refused_forwards.get(reason, 0) + 1

    def rejected_peer_calls(self) -> dict[str, int]:
        """Peer traffic refused by mesh identity, by reason: heartbeats (the mesh services')
        and forwards (the peer listener's)."""
        out = rejected_peer_calls(self._services)
        for reason, n in self.refused_forwards.items():
            out[reason] = out.get(reason, 0) + n
        return out
