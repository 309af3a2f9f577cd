"""Who the balancer routes to: the replicas it owns (from YAML or the controller's
topology) with what their probes last said, and the peer regions' balancers. State and
its small rules only; the balancer hands membership changes to the region core."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from skymesh.balancer.prober import ProbeResult
from skymesh.routing.pairing.base import Role


@dataclass(slots=True)
class ReplicaInfo:
    replica_id: str
    url: str
    home_region: str
    # its prefill/decode role: the config's for a replica it lists (its home region's,
    # for one adopted from another region), the controller's topology's otherwise
    role: Role = "both"
    last_probe: ProbeResult | None = None
    # the replica's prefix-cache counters when first seen (or after it restarted):
    # the hit ratio counts from there
    prefix_queries_base: float | None = None
    prefix_hits_base: float | None = None
    # the model's context the replica serves (its /v1/models; None: not read yet)
    max_model_len: int | None = None

    def note_probe(self, res: ProbeResult) -> None:
        """Keep the latest probe; a healthy one seen first, or with counters that went
        back (the replica restarted), rebases the prefix-cache counters."""
        self.last_probe = res
        if res.healthy and (self.prefix_queries_base is None or res.prefix_queries < self.prefix_queries_base):
            self.prefix_queries_base = res.prefix_queries
            self.prefix_hits_base = res.prefix_hits


@dataclass(slots=True)
class PeerInfo:
    region: str
    http_url: str
    grpc_address: str
    alive: bool = True
    # the balancer id the controller's topology last named for it ("" before any)
    balancer_id: str = ""
    # where forwards go: its peer listener (https:// under the mesh CA; http:// on loopback
    # without tls); None: it has none (a mesh that does not offload)
    peer_url: str | None = None


def merge_replicas(old: Mapping[str, ReplicaInfo], new: Iterable[ReplicaInfo]) -> dict[str, ReplicaInfo]:
    """The new replica set; a replica that stays at the same URL keeps its probe state."""
    out: dict[str, ReplicaInfo] = {}
    for info in new:
        prev = old.get(info.replica_id)
        if prev is not None and prev.url == info.url:
            prev.home_region = info.home_region
            prev.role = info.role
            out[info.replica_id] = prev
        else:
            out[info.replica_id] = info
    return out


def prefix_hit_ratio(replicas: Iterable[ReplicaInfo]) -> float:
    """The replicas' prefix-cache hit ratio since this balancer first saw each (from
    vLLM's prefix_cache_queries / hits counters)."""
    q = h = 0.0
    for info in replicas:
        p = info.last_probe
        if p is None or not p.healthy or info.prefix_queries_base is None:
            continue
        q += p.prefix_queries - info.prefix_queries_base
        h += p.prefix_hits - (info.prefix_hits_base or 0.0)
    return h / q if q > 0 else 0.0
