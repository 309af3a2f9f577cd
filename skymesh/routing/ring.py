"""DualMap's dual hash ring (§3.4): two independent hashes of a key give two candidate
replicas (power of two choices over a consistent-hash ring).

Each replica owns ``virtual_nodes`` points on a 64-bit ring. A key is hashed with two
independent xxhash seeds; each hash walks clockwise to the first point. When both land on
the same replica, the second candidate moves on clockwise to the next *distinct* replica.
Adding or removing a replica only remaps keys in the arcs its points cover.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import xxhash

SEED_A = 0x5EED_0001
SEED_B = 0x5EED_0002
_POINT_SEED = 0x5EED_00FF


class DualHashRing:
    def __init__(self, replicas: Iterable[str] = (), virtual_nodes: int = 160) -> None:
        self.virtual_nodes = virtual_nodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._members: set[str] = set()
        self.set_members(replicas)

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def set_members(self, replicas: Iterable[str]) -> None:
        self._members = set(replicas)
        pts = []
        for r in self._members:
            for v in range(self.virtual_nodes):
                pts.append((xxhash.xxh64_intdigest(f"{r}#{v}".encode(), seed=_POINT_SEED), r))
        pts.sort()
        self._points = [p for p, _ in pts]
        self._owners = [o for _, o in pts]

    def add(self, replica: str) -> None:
        self.set_members(self._members | {replica})

    def remove(self, replica: str) -> None:
        self.set_members(self._members - {replica})

    def _walk(self, h: int) -> int:
        i = bisect.bisect_right(self._points, h)
        return 0 if i == len(self._points) else i

    def primary(self, key: int) -> str:
        """Single-hash lookup (consistent hashing)."""
        if not self._points:
            raise LookupError("empty ring")
        return self._owners[self._walk(_mix(key, SEED_A))]

    def candidates(self, key: int) -> tuple[str, str]:
        """The two candidates for ``key``; distinct whenever the ring has ≥ 2 replicas."""
        if not self._points:
            raise LookupError("empty ring")
        owners = self._owners
        first = owners[self._walk(_mix(key, SEED_A))]
        j = self._walk(_mix(key, SEED_B))
        second = owners[j]
        if second == first and len(self._members) > 1:
            n = len(owners)
            for step in range(1, n):
                cand = owners[(j + step) % n]
                if cand != first:
                    second = cand
                    break
        return first, second

    def walk_from(self, key: int) -> Iterable[str]:
        """Distinct replicas clockwise from ``key`` (for skipping unavailable nodes)."""
        if not self._points:
            return
        seen: set[str] = set()
        i = self._walk(_mix(key, SEED_A))
        n = len(self._owners)
        for step in range(n):
            o = self._owners[(i + step) % n]
            if o not in seen:
                seen.add(o)
                yield o
                if len(seen) == len(self._members):
                    return


def _mix(key: int, seed: int) -> int:
    return xxhash.xxh64_intdigest((key & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"), seed=seed)
