"""Who this balancer is in the mesh: its region, balancer id and epoch, and its mesh
identity (TLS credentials). The base of the ports that
:class:`~skymesh.balancer.server.Balancer` builds for the mesh services
(peer_mesh_port.py, sibling_link_port.py, controller_link_port.py): each implements
:class:`~skymesh.balancer.ports.MeshMember` through it."""

from __future__ import annotations

from collections.abc import Callable

from skymesh.config import MeshConfig
from skymesh.security.pki import Credentials, load_credentials


class MeshMemberPort:
    """Implements :class:`~skymesh.balancer.ports.MeshMember` over the config (read at
    each call: a reload replaces it) and the balancer's identity."""

    def __init__(self, config: Callable[[], MeshConfig], region: str, balancer_id: str, epoch: int) -> None:
        self._config = config
        self.region = region
        self.balancer_id = balancer_id
        self.epoch = epoch

    def mesh_credentials(self) -> Credentials | None:
        return load_credentials(self._config(), self.region)
