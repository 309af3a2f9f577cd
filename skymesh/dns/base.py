"""The DNS provider interface the controller drives.

The controller computes, from its view of the mesh, one :class:`BalancerEndpoint` per
region with its health, and calls :meth:`DnsProvider.sync` whenever that view changes
(and periodically, so drift is repaired). Providers make the DNS name resolve to the
nearest *healthy* balancer: the embedded server by client source network, Route53 by
latency records bound to health checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class BalancerEndpoint:
    region: str  # mesh region name, e.g. "eu-west-1"
    balancer_id: str
    ip: str  # address clients connect to
    port: int  # HTTP port of the balancer
    healthy: bool
    aws_region: str | None = None  # Route53 latency-record region (defaults to region)
    health_path: str = "/health"


class DnsProvider(Protocol):
    name: str

    async def sync(self, endpoints: list[BalancerEndpoint]) -> bool:
        """Make DNS reflect ``endpoints``. Returns True when anything changed.

        Idempotent: calling again with the same endpoints changes nothing.
        """
        ...

    async def close(self) -> None: ...
