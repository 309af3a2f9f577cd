"""Pure failover logic: who owns which replica, given which balancers are alive.

A replica belongs to its home region's balancer. When that balancer is dead, the nearest
live balancer (by configured one-way latency) adopts the replica and treats it as local;
when the home balancer is back, the replica is handed back.
"""

from __future__ import annotations

from skymesh.config import MeshConfig


def region_owners(cfg: MeshConfig, alive: set[str]) -> dict[str, str]:
    """region -> the region whose balancer owns its replicas (itself while alive)."""
    owners: dict[str, str] = {}
    live = [r.name for r in cfg.regions if r.name in alive]
    for region in cfg.regions:
        owner = region.name
        if region.name not in alive and live:
            owner = min(live, key=lambda n: (cfg.one_way_ms(region.name, n), n))
        owners[region.name] = owner
    return owners


def assign_owners(cfg: MeshConfig, alive: set[str]) -> dict[str, str]:
    """replica id -> owning region (the YAML replicas; a dynamic replica is owned like
    the static ones of its home region: :func:`region_owners`)."""
    by_region = region_owners(cfg, alive)
    return {rep.id: by_region[region.name] for region in cfg.regions for rep in region.replicas}


def nearest_alive(cfg: MeshConfig, region: str, alive: set[str]) -> str | None:
    """The region whose balancer serves clients of ``region`` (DNS answer)."""
    if region in alive:
        return region
    live = [r.name for r in cfg.regions if r.name in alive]
    if not live:
        return None
    return min(live, key=lambda n: (cfg.one_way_ms(region, n), n))
