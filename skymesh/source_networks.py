"""Which region a client or peer address comes from: a lookup over the regions'
``source_networks``, run per request (balancer, DNS, delay proxy).

Runtime, not config: :meth:`skymesh.config.MeshConfig.source_network_table` builds the
table once from a validated config; these functions only read it.
"""

from __future__ import annotations

import ipaddress

# (network, region name), most specific network first
SourceNetworkTable = list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str]]


def source_network_of(
    table: SourceNetworkTable, ip: str
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str] | None:
    """The (network, region) of ``table`` holding ``ip`` (most specific first), or None."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    for net, region in table:
        if addr.version == net.version and addr in net:
            return net, region
    return None


def region_of_address(table: SourceNetworkTable, ip: str) -> str | None:
    """The region whose source network holds ``ip`` (most specific wins), None if none."""
    found = source_network_of(table, ip)
    return None if found is None else found[1]
