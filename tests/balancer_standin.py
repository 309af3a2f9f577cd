"""A stand-in for the balancer behind the mesh services' ports (skymesh/balancer/ports.py):
a real (pure) region core and loopback addresses, no HTTP side. PeerMesh and
ControllerLink run against it over real gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from skymesh.balancer.fleet import RegionFleet
from skymesh.balancer.ports import Registration, StatusReport
from skymesh.balancer.prober import SharedPage
from skymesh.config import HostPort
from skymesh.routing.assembly import SiblingSettings
from skymesh.routing.heartbeat import HeartbeatSnapshot
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.region import RegionCore
from skymesh.routing.registry import make_policy
from skymesh.routing.siblings import SiblingMessage
from skymesh.runtime.clock import loop_clock
from skymesh.security.pki import Credentials


def region_core(region: str) -> RegionCore:
    # the real (pure) region core: heartbeats are read from and applied to it
    return RegionCore(region, make_policy("round_robin"), OffloadRouter(region, {}))


@dataclass
class StandInBalancer:
    """Implements the three ports of skymesh.balancer.ports in one object
    (PeerMeshBalancer, SiblingLinkBalancer, ControllerLinkBalancer): hand it to PeerMesh
    as both of its ports, and to ControllerLink."""

    region: str
    grpc_port: int
    # peer region -> the loopback port its balancer answers heartbeats on
    peer_ports: dict[str, int]
    interval_s: float
    controller_listen: str
    creds: Credentials | None = None  # None: loopback-only, no TLS
    advertise_url: str = "http://127.0.0.1:1"
    grpc_advertise: str = ""
    epoch: int = 1
    core: RegionCore = field(init=False)
    controller_connected: bool = False
    topologies: list[Any] = field(default_factory=list)
    extra_services: list[Any] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # a region of several: this one's member suffix, and each sibling's id -> gRPC port
    member: str = "1"
    sibling_ports: dict[str, int] = field(default_factory=dict)
    sibling_dead_after_s: float = 0.3
    fleet: RegionFleet = field(init=False)
    # called after every "dispatch round" (here: every applied sibling message, as the
    # balancer's wake-up after one ends in a dispatch round)
    dispatch_listeners: list[Callable[[], None]] = field(default_factory=list)
    # replica pages to share with the next sibling message, and those siblings shared
    pages_out: list[SharedPage] = field(default_factory=list)
    pages_in: list[SharedPage] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.core = region_core(self.region)
        self.grpc_advertise = self.grpc_advertise or f"127.0.0.1:{self.grpc_port}"
        self.fleet = RegionFleet(self.region, self.balancer_id, self.epoch, self.core,
                                 static_members={sid: f"127.0.0.1:{port}" for sid, port in self.sibling_ports.items()},
                                 settings=SiblingSettings(dead_after_s=self.sibling_dead_after_s, page_lag_s=0.25,
                                                          lease_s=1.0, clock_skew_s=0.25,
                                                          want_memory_s=4 * self.interval_s))
        self.fleet.attach_if_needed(loop_clock())

    @property
    def balancer_id(self) -> str:
        return f"{self.region}-{self.member}"

    def mesh_credentials(self) -> Credentials | None:
        return self.creds

    def heartbeat_interval_s(self) -> float:
        return self.interval_s

    def probe_interval_s(self) -> float:
        return self.interval_s

    def offload_enabled(self) -> bool:
        return True

    def grpc_listen(self) -> HostPort:
        return HostPort(host="127.0.0.1", port=self.grpc_port)

    def peer_regions(self) -> Collection[str]:
        return self.peer_ports.keys()

    def peer_grpc_address(self, region: str) -> str | None:
        port = self.peer_ports.get(region)
        return None if port is None else f"127.0.0.1:{port}"

    def heartbeat_snapshot(self, now: float) -> HeartbeatSnapshot:
        return self.core.view.heartbeat(now)

    def availability(self) -> tuple[int, int]:
        return self.core.view.available_for_new_requests(), self.core.view.queue_length

    def offload_counts(self) -> tuple[int, int]:
        return 0, 0

    def heartbeat_delay_s(self, region: str) -> float:
        return 0.0

    def has_siblings(self) -> bool:
        return self.fleet.has_siblings()

    def sibling_addresses(self) -> dict[str, str]:
        return self.fleet.addresses()

    def expects_siblings(self) -> bool:
        return self.fleet.has_siblings()

    def sibling_message(self) -> SiblingMessage:
        return self.fleet.message(asyncio.get_running_loop().time())

    def sibling_refusal(self, balancer_id: str, epoch: int) -> str | None:
        return self.fleet.refusal(balancer_id, epoch)

    def unresponsive_siblings(self) -> list[str]:
        return self.fleet.unresponsive(loop_clock())

    def apply_sibling_message(self, msg: SiblingMessage) -> bool:
        applied = self.fleet.apply(msg, asyncio.get_running_loop().time())
        if applied:
            for listener in self.dispatch_listeners:
                listener()
        return applied

    def take_shared_pages(self) -> list[SharedPage]:
        pages, self.pages_out = self.pages_out, []
        return pages

    def apply_shared_pages(self, pages: list[SharedPage]) -> None:
        self.pages_in.extend(pages)

    def sibling_interval_s(self) -> float:
        return self.interval_s

    def sibling_keepalive_s(self) -> float:
        return 4 * self.interval_s

    def sibling_page_wait_s(self) -> float:
        return 2 * self.interval_s

    def on_dispatch_round(self, listener: Callable[[], None]) -> None:
        self.dispatch_listeners.append(listener)

    def apply_peer_heartbeat(self, region: str, snapshot: HeartbeatSnapshot, now: float, *,
                             balancer_id: str, epoch: int, seq: int) -> None:
        self.core.peer_heartbeat(region, snapshot, now, balancer_id=balancer_id, epoch=epoch, seq=seq)
        if self.core.view.queue_length:
            self.wake.set()

    def peer_down(self, region: str, why: str, *, cut_forwards: bool = True) -> None:
        self.core.peer_down(region, asyncio.get_running_loop().time(), cut_forwards=cut_forwards)

    def controller_address(self) -> str:
        return self.controller_listen

    def registration(self) -> Registration:
        return Registration(self.region, self.balancer_id, self.epoch, self.advertise_url, self.grpc_advertise)

    def status_report(self) -> StatusReport:
        return StatusReport(queue_length=self.core.view.queue_length, offloaded_out=0, offloaded_in=0,
                            prefix_hit_ratio=0.0, replicas=())

    def set_controller_connected(self, connected: bool) -> None:
        self.controller_connected = connected

    def apply_topology(self, topology: Any) -> None:
        self.topologies.append(topology)
