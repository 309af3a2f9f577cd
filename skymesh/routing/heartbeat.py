"""What a region tells its peers in each heartbeat (SkyWalker's availability exchange);
:class:`~skymesh.routing.offload.OffloadRouter` reads a peer's to decide offload."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeartbeatSnapshot:
    """What this region tells its peers (SkyWalker's availability exchange)."""

    # the replicas a new request may start on: roles ``both`` and ``prefill`` (a decode-only
    # replica cannot take one; every replica while all are ``both``), and those available now
    replicas_total: int
    replicas_available: int
    queue_length: int
    pending_prefill_tokens: int
    # how fast this region's queue drains (requests per second: RegionReadView.offload_rate_per_s;
    # 0 with no history): peers predict the wait of a request they forward here from it
    placements_per_s: float = 0.0
