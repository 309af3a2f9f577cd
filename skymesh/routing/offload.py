"""Cross-region offload (SkyWalker's second routing layer), pure.

A balancer serves its own region first and forwards a queued request to a peer region
only where that peer is expected to answer it sooner. Two triggers:

- ``predicted_ttft`` (default): for each queued request the region core passes how long
  it is expected to wait here before a replica takes it (its place in the queue over the
  queue's service rate: the placement rate measured over the current backlog, else what
  the replicas can take by the TTFT model). A peer's predicted time to first token is the
  link's round trip + the wait there (nothing while it advertises a free replica this
  balancer has not used up since its last heartbeat; else the requests ahead of ours, its
  queue and our own forwards beyond its free replicas, over its advertised service rate)
  + the prefill of the part of the prompt it does not hold. Which prefixes a peer holds is what this region
  already sent there (the *snapshot trie*); which the region itself holds is what it
  dispatched locally, kept in the same trie. The fastest allowed peer wins if it beats
  staying here by ``min_gain_s``: so a region offloads while some local replicas are still
  busy holding requests when that is faster, keeps a follow-up turn where its context
  lives, and stops offloading (pulls back) as the peer's queue grows. Until the region has
  placed requests for a while (no service rate yet) it falls back to the next rule.
- ``saturated`` (SkyWalker's rule): only when no local replica is available, to a peer
  that advertised a free replica not yet used up by our forwards since its heartbeat;
  among those, the longest snapshot-trie prefix wins, ties to the smallest RTT.

A peer is a target only while its last heartbeat is fresh (fewer than ``miss_limit``
intervals old) and its balancer queue is no longer than ``max_remote_queue`` (tau), only
where the offload rules allow the request's origin to go, and only when the request's SLO
class can afford the link: its TTFT target must exceed the round trip.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from skymesh.routing.base import RoutingRequest
from skymesh.routing.cache_sources.routing_history import RoutingHistory
from skymesh.routing.cache_view import CacheView
from skymesh.routing.model import RegionModel
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
    # how fast the peer's balancer has been placing requests on its replicas (per second,
    # its own recent average): what its queue drains at; 0 when it has no history
    placements_per_s: float = 0.0
    # declared dead (heartbeats timed out, its heartbeat stream broke, or the controller
    # said so): no target until its next heartbeat
    down: bool = False
    # per balancer of the region (a region may run several, each heartbeating the
    # region's state): the (epoch, seq) of its last heartbeat applied here
    last_by_sender: dict[str, tuple[int, int]] = field(default_factory=dict)
    # the controller said its balancer is back (alive again, or registered anew) while it
    # is not heard from here: until this time a request only it may serve waits for its
    # first heartbeat instead of being refused (the hand-back of a failover: its replicas
    # leave their adopter at once, its heartbeat stream is being dialled again); how many
    # replicas the controller gave it
    expected_until: float = float("-inf")
    expected_replicas: int = 0


OffloadTrigger = Literal["predicted_ttft", "saturated"]

# the balancers of one peer region whose heartbeat order is kept (bounds PeerState)
MAX_SENDERS_PER_PEER = 64

# how long a peer the controller says is back counts as able to serve before its first
# heartbeat arrives here: a re-dial of its heartbeat stream (connect and TLS over the link,
# woken by the same topology push), with room for a busy host (a restarted balancer's
# first seconds compete with its imports and its replicas' probes). Past it, without a
# heartbeat, the peer is down again and the requests that waited for it are answered 503;
# a request waits at most this long for a peer that never comes, well within its queue
# wait bound (60 s by default).
RETURN_GRACE_S = 10.0


def snapshot_trie_max_nodes(trie_max_nodes: int) -> int:
    """The snapshot trie's bound for a region whose routing history holds ``trie_max_nodes``
    (``policy.trie_max_nodes``): it records regions, not replicas, so a quarter will do."""
    return max(1000, trie_max_nodes // 4)


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
        trigger: OffloadTrigger = "predicted_ttft",
        min_gain_s: float = 0.0,
        prefill_s_per_token: float = 300e-3 / 512,
        first_token_fixed_s: float = 0.02,
        chunk_tokens: int = 64,
    ) -> None:
        self.region = region
        self.rtt_s = dict(rtt_s)
        self.allowed = allowed
        self.max_remote_queue = max_remote_queue
        self.heartbeat_interval_s = heartbeat_interval_s
        self.miss_limit = miss_limit
        self.enabled = enabled
        self.trigger: OffloadTrigger = trigger
        self.min_gain_s = min_gain_s
        # prefill cost of the uncached part of a prompt, here and at a peer (regions of one
        # mesh run the same model): the replica profile's seed until a TTFT model refitted
        # from this region's observed first tokens is attached (``use_model``)
        self.seed_prefill_s_per_token = prefill_s_per_token
        # and the fixed part of a time to first token (whatever the prompt), likewise
        self.seed_first_token_fixed_s = first_token_fixed_s
        self.model: RegionModel | None = None
        self.chunk_tokens = chunk_tokens
        self.peers: dict[str, PeerState] = {}
        # kept so that a tick asks no peer when none can have timed out or lapsed: the
        # oldest last heartbeat of a live peer (None: to be found again after a change),
        # and the peers said to be back and not heard from (expected_until set)
        self._oldest_live_seen: float | None = None
        self._expecting: set[str] = set()
        # the snapshot trie: prefixes sent to each peer (target = its region) and, for the
        # predicted-TTFT trigger, dispatched locally (target = this region); a routing
        # history of regions, read through a CacheView like the replicas' caches
        history = RoutingHistory(BoundedPrefixTrie(trie_max_nodes))
        self.snapshot = CacheView([history], history)

    def use_model(self, model: RegionModel) -> None:
        """Price prefill with the region model's cost model from now on (refitted online
        from the TTFTs this region observes where the policy learns), so the wait here and
        at a peer follow the real hardware rather than the profile's seed."""
        self.model = model

    @property
    def prefill_s_per_token(self) -> float:
        model = self.model
        return self.seed_prefill_s_per_token if model is None else model.prefill_s_per_token

    @property
    def first_token_fixed_s(self) -> float:
        model = self.model
        return self.seed_first_token_fixed_s if model is None else model.first_token_fixed_s

    def reconfigure(
        self, *, allowed: Callable[[str, str], bool], max_remote_queue: int, miss_limit: int,
        trigger: OffloadTrigger | None = None, min_gain_s: float | None = None,
    ) -> None:
        """New rules and bounds (a config reload); every choice from now on uses them. The
        peers' last heartbeats and the snapshot trie are kept."""
        self.allowed = allowed
        self.max_remote_queue = max_remote_queue
        self.miss_limit = miss_limit
        if trigger is not None:
            self.trigger = trigger
        if min_gain_s is not None:
            self.min_gain_s = min_gain_s

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
        placements_per_s: float = 0.0,
    ) -> bool:
        """Apply a heartbeat. Returns False (ignored) for one older than what we have."""
        if region == self.region:
            return False
        p = self.peers.get(region)
        if p is None:
            p = self.peers[region] = PeerState(region=region)
        last = p.last_by_sender.get(balancer_id)
        if last is not None and (epoch, seq) < last:
            return False  # reordered or from a previous incarnation of that balancer
        if last is None and len(p.last_by_sender) >= MAX_SENDERS_PER_PEER:
            # a region of many balancers, or many restarts: forget the longest-known one
            del p.last_by_sender[next(iter(p.last_by_sender))]
        # each of the region's balancers tells the region's state: the latest one wins,
        # and one of them dying leaves the others' heartbeats to keep the region a target
        p.last_by_sender[balancer_id] = (epoch, seq)
        p.balancer_id = balancer_id
        p.epoch, p.seq = epoch, seq
        p.replicas_total = replicas_total
        p.replicas_available = replicas_available
        p.queue_length = queue_length
        p.pending_prefill_tokens = pending_prefill_tokens
        # a hostile or broken peer must not make itself look infinitely fast
        p.placements_per_s = placements_per_s if math.isfinite(placements_per_s) and placements_per_s > 0 else 0.0
        p.last_seen = now
        p.forwarded_since_heartbeat = 0
        p.down = False
        p.expected_until = float("-inf")
        self._oldest_live_seen = None
        self._expecting.discard(region)
        return True

    def expect(self, region: str, now: float, replicas: int) -> bool:
        """The controller says ``region``'s balancer is back, owning ``replicas``: while it
        is not heard from here, it counts as able to serve (:meth:`could_serve`) for
        ``RETURN_GRACE_S``. False (nothing changes) for this region, a peer already fresh,
        or one that owns no replica."""
        if region == self.region or replicas <= 0 or self.is_fresh(region, now):
            return False
        p = self.peers.get(region)
        if p is None:
            p = self.peers[region] = PeerState(region=region, down=True)
        p.expected_until = now + RETURN_GRACE_S
        p.expected_replicas = replicas
        self._oldest_live_seen = None
        self._expecting.add(region)
        return True

    def is_expected(self, region: str, now: float) -> bool:
        """Said to be back by the controller, not heard from yet, within its grace."""
        p = self.peers.get(region)
        return p is not None and now < p.expected_until and not self.is_fresh(region, now)

    def lapsed_expectations(self, now: float) -> list[str]:
        """Peers said to be back whose grace ran out without a heartbeat (each returned
        once): what waited for them is decided again."""
        out: list[str] = []
        if not self._expecting:
            return out
        for r, p in self.peers.items():
            if p.expected_until != float("-inf") and now >= p.expected_until:
                p.expected_until = float("-inf")
                self._expecting.discard(r)
                if not self.is_fresh(r, now):
                    out.append(r)
        return out

    def mark_unavailable(self, region: str) -> None:
        """A forward to ``region`` failed: use none of its replicas until it heartbeats."""
        p = self.peers.get(region)
        if p is not None:
            p.forwarded_since_heartbeat = max(p.forwarded_since_heartbeat, p.replicas_available)

    def mark_down(self, region: str) -> bool:
        """``region`` is dead: no target (nor a reason to keep a request waiting) until its
        next heartbeat. False when it was down already (or never heard from)."""
        p = self.peers.get(region)
        if p is None or p.down:
            return False
        p.down = True
        self._oldest_live_seen = None
        return True

    def newly_dead(self, now: float) -> list[str]:
        """Peers whose heartbeats timed out since they were last seen alive (not yet
        declared down): the heartbeat timeout as an event, for the region core's tick."""
        # is_fresh, read inline (every tick asks)
        limit = self.heartbeat_interval_s * self.miss_limit
        oldest = self._oldest_live_seen
        if oldest is None:
            oldest = self._oldest_live_seen = min(
                (p.last_seen for p in self.peers.values() if not p.down and p.last_seen != float("-inf")),
                default=math.inf)
        if now - oldest <= limit:
            # the live peer heard from longest ago is fresh, so is every other (a later
            # heartbeat's now - last_seen is no larger, rounding included)
            return []
        return [r for r, p in self.peers.items()
                if not p.down and p.last_seen != float("-inf") and not now - p.last_seen <= limit]

    def staleness_s(self, region: str, now: float) -> float:
        p = self.peers.get(region)
        return float("inf") if p is None else now - p.last_seen

    def is_fresh(self, region: str, now: float) -> bool:
        p = self.peers.get(region)
        return p is not None and not p.down and now - p.last_seen <= self.heartbeat_interval_s * self.miss_limit

    def peer_available(self, region: str, now: float) -> bool:
        p = self.peers.get(region)
        return (
            p is not None
            and self.is_fresh(region, now)
            and p.replicas_available - p.forwarded_since_heartbeat >= 1
            and p.queue_length <= self.max_remote_queue
        )

    def affordable(self, region: str, ttft_target_s: float | None) -> bool:
        """A request whose TTFT target is ``ttft_target_s`` (its SLO class's; None: no
        target of its own) can afford the round trip to ``region``: a class whose target
        the link alone uses up is never offloaded there."""
        return ttft_target_s is None or self.rtt_s.get(region, math.inf) < ttft_target_s

    def candidates(self, now: float, source: str | None = None, ttft_target_s: float | None = None) -> list[str]:
        """Available peers the rules allow for a request from ``source`` (None: this
        region's own clients) that its TTFT target can afford."""
        src = source or self.region
        return [
            r for r in self.peers
            if self.allowed(src, r) and self.affordable(r, ttft_target_s) and self.peer_available(r, now)
        ]

    def could_serve(self, now: float, source: str | None = None, ttft_target_s: float | None = None) -> bool:
        """Some allowed and affordable peer is alive and has replicas at all (busy or not),
        or is said to be back by the controller and not heard from yet (:meth:`expect`)."""
        src = source or self.region
        return self.enabled and any(
            self.allowed(src, r) and self.affordable(r, ttft_target_s)
            and ((self.is_fresh(r, now) and p.replicas_total > 0)
                 or (now < p.expected_until and p.expected_replicas > 0))
            for r, p in self.peers.items()
        )

    def choose(self, req: RoutingRequest, now: float, local_wait_s: float | None = None) -> str | None:
        """The peer region to forward ``req`` to, or None to keep it queued locally.

        ``local_wait_s``: how long ``req`` is expected to wait here before a local replica
        takes it (the predicted-TTFT trigger); None (or the ``saturated`` trigger) applies
        SkyWalker's rule, which the caller uses only when no local replica is available."""
        if not self.enabled or req.forwarded:
            return None  # a forwarded request is never forwarded again
        if self.trigger == "predicted_ttft" and local_wait_s is not None:
            return self._fastest_peer(req, now, local_wait_s)
        cands = self.candidates(now, req.origin_region, req.slo_ttft_s)
        if not cands:
            return None
        matched, owners = self.snapshot.longest_match(req.chunk_hashes, set(cands))
        pool = owners if matched > 0 and owners else cands
        return min(pool, key=lambda r: (self.rtt_s.get(r, float("inf")), r))

    def peer_wait_s(self, p: PeerState) -> float:
        """How long a request forwarded to ``p`` now waits there before its own prefill:
        at its balancer nothing while it has a free replica our forwards have not used up,
        else the requests ahead (its queue, plus our forwards beyond its free replicas)
        over its placement rate; then on its replica."""
        return self._wait_at(p, self.prefill_s_per_token)

    @staticmethod
    def _wait_at(p: PeerState, s_per_token: float) -> float:
        """:meth:`peer_wait_s` with the prefill price read once by the caller."""
        # then the prefill already on its replicas ahead of it (its advertised pending
        # prefill, spread over its replicas: the heartbeat carries no per-replica detail)
        on_replica = s_per_token * p.pending_prefill_tokens / max(1, p.replicas_total)
        beyond_free = p.forwarded_since_heartbeat - p.replicas_available
        if p.queue_length == 0 and beyond_free < 0:
            return on_replica
        if p.placements_per_s <= 0.0:
            return math.inf
        return (p.queue_length + max(0, beyond_free) + 1) / p.placements_per_s + on_replica

    def _fastest_peer(self, req: RoutingRequest, now: float, local_wait_s: float) -> str | None:
        src = req.origin_region or self.region
        limit = self.heartbeat_interval_s * self.miss_limit  # is_fresh, read inline
        cands = [
            r for r, p in self.peers.items()
            if self.allowed(src, r) and self.affordable(r, req.slo_ttft_s)
            and not p.down and now - p.last_seen <= limit
            and p.replicas_total > 0 and p.queue_length <= self.max_remote_queue
        ]
        if not cands:
            return None
        held = self.snapshot.match_per_target(req.chunk_hashes, [*cands, self.region])
        # _prefill_s and peer_wait_s with the model's price read once for every peer
        s_per_token, chunk, tokens = self.prefill_s_per_token, self.chunk_tokens, req.prompt_tokens
        local = local_wait_s + s_per_token * max(0, tokens - held.get(self.region, 0) * chunk)
        best, best_s = None, math.inf
        peers, rtt_s = self.peers, self.rtt_s
        for r in cands:
            remote = (rtt_s.get(r, math.inf) + self._wait_at(peers[r], s_per_token)
                      + s_per_token * max(0, tokens - held.get(r, 0) * chunk))
            if remote < best_s or (remote == best_s and best is not None and r < best):
                best, best_s = r, remote
        return best if best_s + self.min_gain_s < local else None

    def soonest_first_token_s(self, req: RoutingRequest, now: float) -> float:
        """When any allowed, affordable peer is expected to start ``req``'s first token at
        the soonest: the round trip plus its wait there (its own prefill left out). inf
        when none could take it (or offload is off, or it was forwarded)."""
        if not self.enabled or req.forwarded:
            return math.inf
        src = req.origin_region or self.region
        return min(
            (self.rtt_s.get(r, math.inf) + self.peer_wait_s(p) for r, p in self.peers.items()
             if self.allowed(src, r) and self.affordable(r, req.slo_ttft_s) and self.is_fresh(r, now)
             and p.replicas_total > 0 and p.queue_length <= self.max_remote_queue),
            default=math.inf,
        )

    def _prefill_s(self, req: RoutingRequest, cached_chunks: int) -> float:
        uncached = req.prompt_tokens - cached_chunks * self.chunk_tokens
        return self.prefill_s_per_token * max(0, uncached)

    def on_local_dispatch(self, req: RoutingRequest, now: float) -> None:
        """``req`` went to a replica of this region: its prefix is held here."""
        if self.enabled and self.trigger == "predicted_ttft":
            self.snapshot.insert(req.chunk_hashes, self.region)

    def on_forwarded(self, req: RoutingRequest, region: str, now: float) -> None:
        self.snapshot.insert(req.chunk_hashes, region)
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
                "down": p.down,
                "expected": self.is_expected(r, now),
                "allowed": self.allowed(self.region, r),
                "staleness_s": None if p.last_seen == float("-inf") else round(now - p.last_seen, 4),
                "replicas_total": p.replicas_total,
                "replicas_available": p.replicas_available,
                "queue_length": p.queue_length,
                "pending_prefill_tokens": p.pending_prefill_tokens,
                "placements_per_s": round(p.placements_per_s, 3),
                "forwarded_total": p.forwarded_total,
                "rtt_ms": round(self.rtt_s.get(r, 0.0) * 1000, 3),
            }
            for r, p in self.peers.items()
        }
