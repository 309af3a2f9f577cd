"""What the balancer's mesh services need of the balancer, and nothing more.

:class:`~skymesh.balancer.services.PeerMesh` (heartbeats with peer balancers),
:class:`~skymesh.balancer.sibling_link.SiblingLink` (the region's other balancers) and
:class:`~skymesh.balancer.services.ControllerLink` (register, report, follow the
topology) talk to the balancer only through the protocols here. The balancer
(:class:`~skymesh.balancer.server.Balancer`) is their composition root: it builds one
small port per protocol over the parts that port needs (peer_mesh_port.py,
sibling_link_port.py, controller_link_port.py; mesh_member.py is their common base) and
hands those to the services. The services therefore never import the server module, and
a test can stand in a small object for the balancer.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from skymesh.balancer.prober import SharedPage
from skymesh.config import HostPort
from skymesh.routing.heartbeat import HeartbeatSnapshot
from skymesh.routing.pairing.base import Role
from skymesh.routing.siblings import SiblingMessage
from skymesh.security.pki import Credentials

VERSION = "0.1.0"


@dataclass(frozen=True, slots=True)
class Registration:
    """What the balancer tells the controller about itself when it registers."""

    region: str
    balancer_id: str
    epoch: int
    http_url: str
    grpc_address: str
    version: str = VERSION
    # this balancer's own gRPC listener (one member of the region's fleet); grpc_address
    # is the region's advertised one ("": no reachable one known, never a wildcard)
    member_grpc_address: str = ""
    # and its own HTTP URL ("": none known); http_url is the region's entry
    member_http_url: str = ""


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One replica this balancer owns, as the controller report carries it."""

    replica_id: str
    url: str
    healthy: bool = False
    available: bool = False
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    role: Role = "both"  # its prefill/decode role (skymesh/routing/pairing)


@dataclass(frozen=True, slots=True)
class StatusReport:
    """The balancer's state for the controller: the typed fields its report carries, and
    the whole /admin/status document (sent along as JSON)."""

    queue_length: int
    offloaded_out: int
    offloaded_in: int
    prefix_hit_ratio: float
    replicas: tuple[ReplicaStatus, ...]
    admin: dict[str, Any] = field(default_factory=dict)


class MeshMember(Protocol):
    """Who this balancer is in the mesh, and its mesh identity (TLS)."""

    @property
    def region(self) -> str: ...

    @property
    def balancer_id(self) -> str: ...

    @property
    def epoch(self) -> int: ...

    def mesh_credentials(self) -> Credentials | None:
        """This balancer's mesh certificate (None: loopback-only local mode without TLS)."""
        ...


class SiblingLinkBalancer(MeshMember, Protocol):
    """What :class:`~skymesh.balancer.sibling_link.SiblingLink` needs of the balancer."""

    def has_siblings(self) -> bool:
        """The region runs more than this balancer (config or controller)."""
        ...

    def sibling_addresses(self) -> dict[str, str]:
        """Sibling balancer id -> its own gRPC address (not the region's entry)."""
        ...

    def sibling_message(self) -> SiblingMessage:
        """This balancer's state now (the region core's ``sibling_message``)."""
        ...

    def apply_sibling_message(self, msg: SiblingMessage) -> bool:
        """A sibling's state (the region core's ``sibling_state``); False: ignored."""
        ...

    def take_shared_pages(self) -> list[SharedPage]:
        """The replica pages this balancer scraped since the last call (its siblings do not
        probe those replicas: skymesh/routing/probe_owners.py); [] without siblings."""
        ...

    def apply_shared_pages(self, pages: list[SharedPage]) -> None:
        """Replica pages a sibling scraped, dated on this balancer's clock: each one newer
        than what it saw of the replica counts as its own probe."""
        ...

    def expects_siblings(self) -> bool:
        """The region runs (or may come to run) more balancers than this one: the config
        lists siblings, or its balancers register themselves (an Auto Scaling group), so
        the gRPC listener must serve the sibling channel from the start."""
        ...

    def sibling_refusal(self, balancer_id: str, epoch: int) -> str | None:
        """Why a sibling message claiming ``balancer_id`` at ``epoch`` is refused (the
        controller's topology, or the config, does not list that id or that epoch); None:
        accepted."""
        ...

    def sibling_interval_s(self) -> float:
        """The most often the protocol's moves go out (siblings.interval_s)."""
        ...

    def sibling_keepalive_s(self) -> float:
        """How often a balancer with nothing new still speaks (siblings.keepalive_s)."""
        ...

    def sibling_page_wait_s(self) -> float:
        """The longest a replica page scraped here waits for a message going anyway
        before one goes for it alone (half a probe interval, at most a keepalive)."""
        ...

    def on_dispatch_round(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after every dispatch round (on the event loop)."""
        ...


class PeerMeshBalancer(MeshMember, Protocol):
    """What :class:`~skymesh.balancer.services.PeerMesh` needs of the balancer (it also
    serves the siblings' streams on the same gRPC listener: those go through a
    :class:`SiblingLinkBalancer`)."""

    def heartbeat_interval_s(self) -> float: ...

    def probe_interval_s(self) -> float: ...

    def offload_enabled(self) -> bool:
        """Whether this region offloads to its peers (offload.enabled)."""
        ...

    def grpc_listen(self) -> HostPort:
        """Where the peers' heartbeat streams are answered."""
        ...

    def peer_regions(self) -> Collection[str]: ...

    def peer_grpc_address(self, region: str) -> str | None:
        """Where ``region``'s balancer answers heartbeats (None: no such peer)."""
        ...

    def heartbeat_snapshot(self, now: float) -> HeartbeatSnapshot:
        """This region's availability, as a heartbeat carries it."""
        ...

    def availability(self) -> tuple[int, int]:
        """(replicas a new request may start on that are available, queue length): the
        heartbeat's figures; a heartbeat goes out at once when they move."""
        ...

    def offload_counts(self) -> tuple[int, int]:
        """Requests offloaded (out to peers, in from peers) since start."""
        ...

    def heartbeat_delay_s(self, region: str) -> float:
        """How long a heartbeat from ``region`` is held before it applies (the emulated
        one-way link latency; 0 without latency emulation)."""
        ...

    def apply_peer_heartbeat(self, region: str, snapshot: HeartbeatSnapshot, now: float, *,
                             balancer_id: str, epoch: int, seq: int) -> None: ...

    def peer_down(self, region: str, why: str, *, cut_forwards: bool = True) -> None: ...


class ControllerLinkBalancer(MeshMember, Protocol):
    """What :class:`~skymesh.balancer.services.ControllerLink` needs of the balancer."""

    def controller_address(self) -> str: ...

    def registration(self) -> Registration: ...

    def status_report(self) -> StatusReport: ...

    def set_controller_connected(self, connected: bool) -> None: ...

    def unresponsive_siblings(self) -> list[str]:
        """Siblings the topology lists alive that this balancer has not heard from past
        the siblings' dead-after time (its reports name them to the controller)."""
        ...

    def apply_topology(self, topology: Any) -> None:
        """Take the controller's topology (a mesh_pb2.Topology): this region's replicas
        and the peers' liveness; an older version than the one applied is ignored."""
        ...


class MeshServicesBalancer(Protocol):
    """A balancer the mesh services attach to (see services.attach_services): the list
    they join, and the ports it hands them."""

    @property
    def extra_services(self) -> list[Any]: ...

    @property
    def peer_mesh_port(self) -> PeerMeshBalancer: ...

    @property
    def sibling_link_port(self) -> SiblingLinkBalancer: ...

    @property
    def controller_link_port(self) -> ControllerLinkBalancer: ...
