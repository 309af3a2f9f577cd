"""What the controller link (:class:`~skymesh.balancer.services.ControllerLink`) may ask
of the balancer: :class:`ControllerLinkPort` implements
:class:`~skymesh.balancer.ports.ControllerLinkBalancer`: who this balancer registers as
and where it is reached, whether the controller is connected, and the controller's
topology applied to the region's fleet, the replicas this balancer owns and the peer
regions (through the peer port). The balancer (server.py) builds it and hands it to the
mesh services; membership and the status document stay the balancer's, passed in as
callables."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from skymesh.balancer.fleet import RegionFleet
from skymesh.balancer.identity import member_host
from skymesh.balancer.membership import PeerInfo, ReplicaInfo
from skymesh.balancer.mesh_member import MeshMemberPort
from skymesh.balancer.peer_mesh_port import PeerMeshPort
from skymesh.balancer.ports import Registration, StatusReport
from skymesh.config import HostPort, MeshConfig
from skymesh.routing.pairing.base import ROLES, Role
from skymesh.runtime.clock import loop_clock

log = logging.getLogger("skymesh.balancer")


class ControllerLinkPort(MeshMemberPort):
    """This balancer as the controller sees it, and the controller's topology applied."""

    def __init__(self, config: Callable[[], MeshConfig], region: str, balancer_id: str, epoch: int, *,
                 advertise_host: str | None, fleet: RegionFleet, peers: Mapping[str, PeerInfo],
                 region_names: frozenset[str], peer_mesh_port: PeerMeshPort,
                 set_replicas: Callable[[list[ReplicaInfo]], None], set_draining: Callable[[list[str]], None],
                 replicas: Callable[[], Mapping[str, ReplicaInfo]], status_report: Callable[[], StatusReport],
                 http_port: Callable[[], int], services: Sequence[Any]) -> None:
        """``advertise_host``: where the siblings and the controller reach this balancer
        (None: its listen host unless a wildcard); ``set_replicas`` / ``set_draining``:
        the balancer's membership; ``replicas``: the replicas it owns now;
        ``status_report``: its status document; ``http_port``: its bound HTTP port;
        ``services``: its mesh services (the peers' gRPC server's bound port)."""
        super().__init__(config, region, balancer_id, epoch)
        self.advertise_host = advertise_host
        self.fleet = fleet
        self.peers = peers
        # an adopted origin a peer's forwards may claim must name a configured region
        self.region_names = region_names
        self.peer_mesh_port = peer_mesh_port
        self._set_replicas = set_replicas
        self._set_draining = set_draining
        self._replicas = replicas
        self._status_report = status_report
        self._http_port = http_port
        self._services = services
        self.controller_connected = False
        self.topology_version = 0

    def controller_address(self) -> str:
        return str(self._config().controller.listen)

    def registration(self) -> Registration:
        region_cfg = self._config().region(self.region)
        return Registration(
            region=self.region,
            balancer_id=self.balancer_id,
            epoch=self.epoch,
            http_url=region_cfg.balancer.advertise_url,
            grpc_address=str(region_cfg.balancer.grpc_advertise),
            member_grpc_address=self.member_grpc_address(),
            member_http_url=self.member_http_url(),
        )

    def _member_host(self, listen: HostPort) -> str | None:
        return member_host(self.advertise_host, listen.host)

    def member_grpc_address(self) -> str:
        """This balancer's own gRPC address (the bound port when it listens on port 0) at
        its reachable host; "" when it knows none (a wildcard listener, no advertised host)."""
        listen = self._config().region(self.region).balancer.grpc_listen
        host = self._member_host(listen)
        if host is None:
            return ""
        port = listen.port
        for svc in self._services:
            bound = getattr(svc, "bound_port", None)
            if isinstance(bound, int) and bound > 0:  # the peers' gRPC server
                port = bound
        return str(HostPort(host, port))

    def member_http_url(self) -> str:
        """This balancer's own HTTP URL (its bound port) at its reachable host ("": none)."""
        listen = self._config().region(self.region).balancer.listen
        host = self._member_host(listen)
        return "" if host is None else HostPort(host, self._http_port()).http_url

    def status_report(self) -> StatusReport:
        return self._status_report()

    def set_controller_connected(self, connected: bool) -> None:
        self.controller_connected = connected

    def unresponsive_siblings(self) -> list[str]:
        return self.fleet.unresponsive(loop_clock())

    def _role_of(self, replica_id: str, role: str) -> Role:
        """A replica's role as the topology names it; a controller that names none (one
        before roles) leaves the config's for a replica it lists, else ``both``. A role
        this balancer does not know (a newer controller) is read as ``both`` and logged."""
        if role in ROLES:
            return cast(Role, role)
        if role:
            log.warning("topology names an unknown replica role; taken as both",
                        extra={"replica_id": replica_id, "role": role[:32]})
            return "both"
        listed = {rep.id: rep.role for r in self._config().regions for rep in r.replicas}
        return listed.get(replica_id, "both")

    def apply_topology(self, topology: Any) -> None:
        if topology.version <= self.topology_version:
            return
        self.topology_version = topology.version
        for assignment in topology.balancers:
            if assignment.region == self.region:
                self.fleet.topology_members(assignment.members, loop_clock())
                self._set_replicas(
                    [
                        ReplicaInfo(r.replica_id, r.url, r.home_region or self.region,
                                    self._role_of(r.replica_id, r.role))
                        for r in assignment.replicas
                    ]
                )
                self._set_draining([r.replica_id for r in assignment.replicas if r.draining])
            elif assignment.region in self.peers:
                peer = self.peers[assignment.region]
                if peer.alive and not assignment.alive:
                    # the controller's probes found its balancer dead, or it deregistered to
                    # drain: what waits for it is decided again now; forwards in flight are
                    # left to a draining balancer to finish (a dead one's break on their own)
                    self.peer_mesh_port.peer_down(assignment.region, "controller declared its balancer dead",
                                                  cut_forwards=False)
                elif assignment.alive and (not peer.alive or (
                        peer.balancer_id and assignment.balancer_id and assignment.balancer_id != peer.balancer_id)):
                    # back from a failover, or restarted (a new registration): its heartbeat
                    # stream is dialled again now, and what only it may serve waits for it
                    self.peer_mesh_port.peer_back(assignment.region, len(assignment.replicas),
                                                  "alive again" if not peer.alive else "registered anew")
                peer.alive = assignment.alive
                peer.balancer_id = assignment.balancer_id or peer.balancer_id
                if assignment.http_url:
                    peer.http_url = assignment.http_url
                # the regions whose replicas it owns besides its own: origins its forwards
                # may claim (the peer listener binds the claim to its certificate)
                self.peer_mesh_port.set_adoptions(assignment.region, frozenset(
                    r.home_region for r in assignment.replicas
                    if r.home_region != assignment.region and r.home_region in self.region_names))
        log.info("topology applied", extra={"version": topology.version, "replicas": len(self._replicas())})
