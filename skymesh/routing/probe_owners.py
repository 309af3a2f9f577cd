"""Shared probing in a fleet: each replica's metrics page is scraped by one balancer of
the region and shared with the others over the sibling channel, so a fleet of N probes
its replicas as often as one balancer does, not N times as often.

Who probes a replica: the members ranked by rendezvous hashing (highest random weight)
of the replica id with each member id, over the agreed member list (the controller's
topology, else the config: the list the push budget's homes come from). The first of
that order probes it; the member ranked k-th takes over when the newest page of the
replica (its own or a sibling's) is older than ``k × stale_after_s`` — the owner died,
stalled or its messages stopped — so one silent member never leaves a replica
unwatched, and the takeover is staggered instead of every member at once. A member that
joins or leaves moves only the replicas it ranks first on (rendezvous hashing's
property), and a member that has heard no page yet probes what it cannot see.

Pure: no clock (``now`` is passed in), no I/O; the daemon keeps one per balancer.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

_SEED = 0x5EED_9B0B


def _weight(member_id: str, replica_id: str) -> int:
    return xxhash.xxh64_intdigest(f"{member_id}\x00{replica_id}".encode(), seed=_SEED)


def probe_order(replica_id: str, members: Iterable[str]) -> list[str]:
    """The members in the order they probe ``replica_id``: the owner first."""
    return sorted(set(members), key=lambda m: (_weight(m, replica_id), m), reverse=True)


class ProbeOwners:
    """Which replicas this balancer probes now, and the newest page seen of each."""

    def __init__(self, balancer_id: str, stale_after_s: float) -> None:
        self.balancer_id = balancer_id
        self.stale_after_s = stale_after_s
        self._members: frozenset[str] = frozenset({balancer_id})
        self._rank: dict[str, int] = {}  # replica -> this member's place in its probe order
        self._page_at: dict[str, float] = {}  # replica -> send time of the newest page applied

    @property
    def members(self) -> frozenset[str]:
        return self._members

    def set_members(self, member_ids: Iterable[str]) -> None:
        """The region's members (this one is always among them)."""
        members = frozenset({*member_ids, self.balancer_id})
        if members != self._members:
            self._members = members
            self._rank.clear()

    def rank(self, replica_id: str) -> int:
        """This member's place in the replica's probe order (0: it owns the replica)."""
        r = self._rank.get(replica_id)
        if r is None:
            r = self._rank[replica_id] = probe_order(replica_id, self._members).index(self.balancer_id)
        return r

    def owns(self, replica_id: str) -> bool:
        return self.rank(replica_id) == 0

    def to_probe(self, replica_ids: Iterable[str], now: float) -> list[str]:
        """The replicas this member scrapes in a probe round at ``now``: those it owns, and
        those whose newest page is older than its rank times ``stale_after_s``."""
        out = []
        for rid in replica_ids:
            rank = self.rank(rid)
            if rank == 0 or now - self._page_at.get(rid, float("-inf")) > rank * self.stale_after_s:
                out.append(rid)
        return out

    def take_page(self, replica_id: str, sent_at: float) -> bool:
        """A page of ``replica_id`` scraped at ``sent_at`` (this member's clock) arrived:
        True when it is newer than every page applied before (apply it), else False (an
        older or repeated page: skip it)."""
        if sent_at <= self._page_at.get(replica_id, float("-inf")):
            return False
        self._page_at[replica_id] = sent_at
        return True

    def forget(self, keep: Iterable[str]) -> None:
        """Drop what is kept of replicas no longer members of the region."""
        kept = set(keep)
        for rid in [r for r in self._page_at if r not in kept]:
            del self._page_at[rid]
        for rid in [r for r in self._rank if r not in kept]:
            del self._rank[rid]
