"""Cross-region offload (SkyWalker's second routing layer), pure.

A balancer serves its own region first. Only when no local replica is available does it
look at peers: a peer region is *available* when its last heartbeat is fresh (fewer than
``miss_limit`` intervals old), it reported at least one available replica that this
balancer has not already used up by forwarding since that heartbeat, and its balancer
queue is no longer than ``max_remote_queue`` (tau). Among available peers allowed by the
offload rules, the one whose *snapshot trie* (what this region already sent there) holds
the longest prefix of the request wins; ties go to the smallest RTT.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from skymesh.routing.base import RoutingRequest
from skymesh.routing.trie import BoundedPrefixTrie


@dataclass(slots=True)
class PeerState:
    region: str
    balancer_id: str = ""
    epoch: int = 0
    seq: int = 0
    replicas_total: int = 0
    replicas_available: int = 0
    queue_length: int = 0
    pending_prefill_tokens: int = 0
    last_seen: float = float("-inf")
    # forwards sent since its last heartbeat: each uses one of its advertised replicas
    forwarded_since_heartbeat: int = 0
    forwarded_total: int = 0


class OffloadRouter:
    def __init__(
        self,
        region: str,
        rtt_s: Mapping[str, float],
        *,
        allowed: Callable[[str, str], bool] = lambda src, dst: True,
        max_remote_queue: int = 4,
        heartbeat_interval_s: float = 0.1,
        miss_limit: int = 3,
        trie_max_nodes: int = 50_000,
        enabled: bool = True,
    ) -> None:
        self.region = region
        self.rtt_s = dict(rtt_s)
        self.allowed = allowed
        self.max_remote_queue = max_remote_queue
        self.heartbeat_interval_s = heartbeat_interval_s
        self.miss_limit = miss_limit
        self.enabled = enabled
        self.peers: dict[str, PeerState] = {}
        self.snapshot = BoundedPrefixTrie(trie_max_nodes)

    def reconfigure(
        self, *, allowed: Callable[[str, str], bool], max_remote_queue: int, miss_limit: int
    ) -> None:
        """New rules and bounds (a config reload); every choice from now on uses them. The
        peers' last heartbeats and the snapshot trie are kept."""
        self.allowed = allowed
        self.max_remote_queue = max_remote_queue
        self.miss_limit = miss_limit

    def update_peer(
        self,
        region: str,
        *,
        now: float,
        balancer_id: str = "",
        epoch: int = 0,
        seq: int = 0,
        replicas_total: int = 0,
        replicas_available: int = 0,
        queue_length: int = 0,
        pending_prefill_tokens: int = 0,
    ) -> bool:
        """Apply a heartbeat. Returns False (ignored) for one older than what we have."""
        if region == self.region:
            return False
        p = self.peers.get(region)
        if p is None:
            p = self.peers[region] = PeerState(region=region)
        elif (epoch, seq) < (p.epoch, p.seq):
            return False  # reordered or from a previous incarnation of the balancer
        p.balancer_id = balancer_id
        p.epoch, p.seq = epoch, seq
        p.replicas_total = replicas_total
        p.replicas_available = replicas_available
        p.queue_length = queue_length
        p.pending_prefill_tokens = pending_prefill_tokens
        p.last_seen = now
        p.forwarded_since_heartbeat = 0
        return True

    def mark_unavailable(self, region: str) -> None:
        """A forward to ``region`` failed: use none of its replicas until it heartbeats."""
        p = self.peers.get(region)
        if p is not None:
            p.forwarded_since_heartbeat = max(p.forwarded_since_heartbeat, p.replicas_available)

    def remove_peer(self, region: str) -> None:
        self.peers.pop(region, None)
        self.snapshot.remove_target(region)

    def staleness_s(self, region: str, now: float) -> float:
        p = self.peers.get(region)
        return float("inf") if p is None else now - p.last_seen

    def is_fresh(self, region: str, now: float) -> bool:
        return self.staleness_s(region, now) <= self.heartbeat_interval_s * self.miss_limit

    def peer_available(self, region: str, now: float) -> bool:
        p = self.peers.get(region)
        return (
            p is not None
            and self.is_fresh(region, now)
            and p.replicas_available - p.forwarded_since_heartbeat >= 1
            and p.queue_length <= self.max_remote_queue
        )

    def candidates(self, now: float, source: str | None = None) -> list[str]:
        """Available peers the rules allow for a request from ``source`` (None: this
        region's own clients)."""
        src = source or self.region
        return [r for r in self.peers if self.allowed(src, r) and self.peer_available(r, now)]

    def could_serve(self, now: float, source: str | None = None) -> bool:
        """Some allowed peer is alive and has replicas at all (busy or not)."""
        src = source or self.region
        return self.enabled and any(
            self.allowed(src, r) and self.is_fresh(r, now) and p.replicas_total > 0
            for r, p in self.peers.items()
        )

    def choose(self, req: RoutingRequest, now: float) -> str | None:
        """The peer region to forward ``req`` to, or None to keep it queued locally."""
        if not self.enabled or req.forwarded:
            return None  # a forwarded request is never forwarded again
        cands = self.candidates(now, req.origin_region)
        if not cands:
            return None
        matched, owners = self.snapshot.longest_match(req.chunk_hashes, set(cands))
        pool = owners if matched > 0 and owners else cands
        return min(pool, key=lambda r: (self.rtt_s.get(r, float("inf")), r))

    def on_forwarded(self, req: RoutingRequest, region: str, now: float) -> None:
        self.snapshot.insert(req.chunk_hashes, region, now)
        p = self.peers.get(region)
        if p is not None:
            p.forwarded_since_heartbeat += 1
            p.forwarded_total += 1

    def snapshot_state(self, now: float) -> dict[str, Any]:
        return {
            r: {
                "balancer_id": p.balancer_id,
                "epoch": p.epoch,
                "available": self.peer_available(r, now),
                "allowed": self.allowed(self.region, r),
                "staleness_s": None if p.last_seen == float("-inf") else round(now - p.last_seen, 4),
                "replicas_total": p.replicas_total,
                "replicas_available": p.replicas_available,
                "queue_length": p.queue_length,
                "pending_prefill_tokens": p.pending_prefill_tokens,
                "forwarded_total": p.forwarded_total,
                "rtt_ms": round(self.rtt_s.get(r, 0.0) * 1000, 3),
            }
            for r, p in self.peers.items()
        }
