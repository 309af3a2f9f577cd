"""The ``prefix`` queue discipline (FEATHER): when a replica frees up, the queued request
that best matches what it already holds goes first. Pure: no clock, no I/O.

A prompt is its vector of cumulative chunk hashes (``RoutingRequest.chunk_hashes``), so
"how much of it does replica p hold" is the length of its longest prefix in p's cache, read
through the same :class:`CacheView` the policies read (the replica's KV-event index while
events flow, else this discipline's own routing history). A request's key on p is what p
would still have to prefill for it: its prompt tokens less the tokens of the chunks p holds
(the *missing chunks*, in tokens, so a partial tail chunk counts as work too). The request
with the smallest key on p is p's best match; among equals, the older one.

Kept incrementally, never by rescanning the queue:

- ``_sharers`` maps a chunk hash to the queued requests whose prompt has it. When this
  balancer sends a request to p, only the chunks p did not hold before are new there; the
  queued requests that share one of them get a better key on p (walked deepest chunk first,
  so each such request is updated once).
- One lazy min-heap per (priority, replica) holds a request's entry only while p holds some
  of its prompt; one per priority holds every queued request keyed by its whole prompt (what
  a replica that holds none of it would prefill). The best match on p is the smaller of the
  two tops: a request p holds part of has a smaller key in p's heap than in the shared one.
  Memory is the queue plus the (request, replica) pairs that share a prefix, not queue x
  replicas. An entry whose request left, or whose key changed since it was pushed, is
  skipped when it reaches the top; heaps are rebuilt when stale entries outnumber live ones.
- A cache forgets (vLLM evicts blocks, the history trie drops its least recent leaves): an
  entry reaching the top of p's heap is checked against the cache before it is chosen, and
  pushed back with its true key when that differs.

The discipline orders, the policy places: :meth:`PrefixOrder.dispatch_order` gives each
available replica (one per replica per round, as many rounds as its free dispatch slots) its
best-matching request, and the dispatcher offers them to the policy first, then the rest of
the priority in arrival order. A cache-aware policy then sends a request where its prefix
is; whatever it decides holds (residency, DualMap's candidates, retries' exclusions).

Starvation and tail bound: a request queued ``max_age_s``, or ``ttft_share`` of its TTFT
target (its class's, else the balancer's SLO) if that is sooner, goes first, in arrival
order, ahead of every match. A long prompt nobody shares would otherwise always lose to
cheaper ones; and ordering purely by match is shortest-prefill-first, which lowers the
median TTFT but lets the unmatched requests' tail run past their targets (measured:
docs/benchmarks.md, "Queue order: prefix (FEATHER) vs fcfs"). Priorities order across
classes as in every discipline.

Why by hand: heapq is the heap; the incremental bookkeeping over a prefix cache is the
algorithm itself, which no library provides.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from skymesh.routing.base import ReplicaView, RoutingRequest
from skymesh.routing.kv_index import CacheView, KvIndexes
from skymesh.routing.queueing import PriorityQueue
from skymesh.routing.trie import BoundedPrefixTrie

# (missing prefill tokens on the replica, arrival, admission sequence, request id)
_Entry = tuple[int, float, int, str]
# a heap is rebuilt from its live entries once it holds this many more than twice them
_COMPACT_SLACK = 64


@dataclass(slots=True)
class _Queued:
    req: RoutingRequest
    priority: int
    seq: int
    # replica -> chunks of this prompt it holds, as last known (absent: none)
    held_chunks: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _LazyHeap:
    entries: list[_Entry] = field(default_factory=list)

    def push(self, entry: _Entry) -> None:
        heapq.heappush(self.entries, entry)

    def pop(self) -> _Entry:
        return heapq.heappop(self.entries)

    def top(self) -> _Entry | None:
        return self.entries[0] if self.entries else None

    def compact(self, live: int, keep: set[_Entry]) -> None:
        if len(self.entries) > 2 * live + _COMPACT_SLACK:
            self.entries = [e for e in self.entries if e in keep]
            heapq.heapify(self.entries)


class PrefixOrder:
    """The ``prefix`` discipline (see the module docstring)."""

    def __init__(self, *, chunk_tokens: int, max_age_s: float, kv_indexes: KvIndexes | None = None,
                 trie_max_nodes: int = 200_000, ttft_share: float = 1.0, default_slo_s: float | None = None) -> None:
        self.chunk_tokens = chunk_tokens
        self.max_age_s = max_age_s
        self.ttft_share = ttft_share
        self.default_slo_s = default_slo_s
        # its own routing history (a trie of what it saw sent where), read through the same
        # view as the policies: a replica's KV-event index answers for it while events flow
        self.cache = CacheView(BoundedPrefixTrie(trie_max_nodes), kv_indexes)
        self.replica_ids: list[str] = []
        self._queued: dict[str, _Queued] = {}
        self._sharers: dict[int, set[str]] = {}
        self._by_replica: dict[tuple[int, str], _LazyHeap] = {}
        self._whole: dict[int, _LazyHeap] = {}  # priority -> every request, keyed by its prompt
        # priority -> (when it is overdue, arrival, admission sequence, request id)
        self._overdue_at: dict[int, list[tuple[float, float, int, str]]] = {}
        self._seq = 0
        self.decisions = 0
        self.picks_matched = 0  # picks a replica held some of (the rest were its cheapest prompt)
        self.picks_overdue = 0
        self.corrections = 0  # heap tops the cache no longer held as recorded (evictions)

    # ------------------------------------------------------------------ keys

    def _missing(self, q: _Queued, replica_id: str | None) -> int:
        held = q.held_chunks.get(replica_id, 0) if replica_id is not None else 0
        return max(0, q.req.prompt_tokens - held * self.chunk_tokens)

    def _entry(self, q: _Queued, replica_id: str | None) -> _Entry:
        return (self._missing(q, replica_id), q.req.arrival, q.seq, q.req.request_id)

    def _heap(self, priority: int, replica_id: str) -> _LazyHeap:
        heap = self._by_replica.get((priority, replica_id))
        if heap is None:
            heap = self._by_replica[(priority, replica_id)] = _LazyHeap()
        return heap

    def _live(self, entry: _Entry, replica_id: str | None) -> bool:
        q = self._queued.get(entry[3])
        return q is not None and q.seq == entry[2] and entry == self._entry(q, replica_id)

    # ------------------------------------------------------------------ membership

    def set_replicas(self, replica_ids: Sequence[str]) -> None:
        gone = set(self.replica_ids) - set(replica_ids)
        added = [r for r in replica_ids if r not in self.replica_ids]
        self.replica_ids = list(replica_ids)
        for rid in gone:
            self.cache.remove_target(rid)
            for key in [k for k in self._by_replica if k[1] == rid]:
                del self._by_replica[key]
            for q in self._queued.values():
                q.held_chunks.pop(rid, None)
        if added:
            for q in self._queued.values():
                self._score(q, added)

    # ------------------------------------------------------------------ queue events

    def on_queued(self, req: RoutingRequest) -> None:
        """A request joined the queue (new, or back after a failed attempt or a peer's refusal)."""
        self._seq += 1
        q = _Queued(req, req.priority, self._seq)
        self._queued[req.request_id] = q
        for h in req.chunk_hashes:
            self._sharers.setdefault(h, set()).add(req.request_id)
        whole = self._whole.get(req.priority)
        if whole is None:
            whole = self._whole[req.priority] = _LazyHeap()
        whole.push(self._entry(q, None))
        heapq.heappush(self._overdue_at.setdefault(req.priority, []), (self._due(req), req.arrival, q.seq, req.request_id))
        self._score(q, self.replica_ids)

    def _score(self, q: _Queued, replica_ids: Sequence[str]) -> None:
        if not q.req.chunk_hashes or not replica_ids:
            return
        for rid, chunks in self.cache.match_per_target(q.req.chunk_hashes, replica_ids).items():
            if chunks > 0:
                q.held_chunks[rid] = chunks
                self._heap(q.priority, rid).push(self._entry(q, rid))

    def on_dequeued(self, request_id: str) -> None:
        """A request left the queue (placed, offloaded, cancelled, expired)."""
        q = self._queued.pop(request_id, None)
        if q is None:
            return
        for h in q.req.chunk_hashes:
            sharing = self._sharers.get(h)
            if sharing is not None:
                sharing.discard(request_id)
                if not sharing:
                    del self._sharers[h]

    def on_dispatch(self, req: RoutingRequest, replica_id: str, now: float) -> None:
        """``req`` was sent to ``replica_id``: the chunks it did not hold are there now."""
        chunks = req.chunk_hashes
        if not chunks:
            return
        before = self.cache.match_per_target(chunks, [replica_id]).get(replica_id, 0)
        self.cache.insert(chunks, replica_id, now)
        updated: set[str] = set()
        # deepest new chunk first: a queued request sharing it gets its best key at once
        for depth in range(len(chunks), before, -1):
            for rid in self._sharers.get(chunks[depth - 1], ()):
                if rid in updated:
                    continue
                updated.add(rid)
                q = self._queued[rid]
                if q.held_chunks.get(replica_id, 0) < depth:
                    q.held_chunks[replica_id] = depth
                    self._heap(q.priority, replica_id).push(self._entry(q, replica_id))

    # ------------------------------------------------------------------ ordering

    def dispatch_order(self, queue: PriorityQueue[Any], replicas: Mapping[str, ReplicaView],
                       free_slots: Mapping[str, int], now: float) -> list[str]:
        """The order in which the dispatcher offers queued requests to the policy: per
        priority (highest first), the overdue ones in arrival order, then each free
        replica's best matches (round-robin over the replicas, as many as the free slots
        left), then the rest in queue order."""
        order: list[str] = []
        slots = {r: n for r, n in free_slots.items() if n > 0}
        for priority, ids in queue.lanes():
            first = self._overdue(priority, now)
            self.picks_overdue += len(first)
            taken = set(first)
            budget = sum(slots.values()) - len(first)
            if budget > 0:
                picks = self._best_matches(priority, slots, taken, budget)
                first.extend(picks)
                taken.update(picks)
            order.extend(first)
            order.extend(rid for rid in ids if rid not in taken)
            # the free slots this priority's requests will fill are gone for the next one
            used = min(len(ids), sum(slots.values()))
            for r in list(slots):
                if used <= 0:
                    break
                spent = min(slots[r], used)
                slots[r] -= spent
                used -= spent
                if not slots[r]:
                    del slots[r]
            self._compact(priority)
        self.decisions += 1
        return order

    def _due(self, req: RoutingRequest) -> float:
        """When ``req`` is overdue: it then goes first, in arrival order."""
        bound = self.max_age_s
        target = req.slo_ttft_s if req.slo_ttft_s is not None else self.default_slo_s
        if target is not None:
            bound = min(bound, self.ttft_share * target)
        return req.arrival + bound

    def _overdue(self, priority: int, now: float) -> list[str]:
        heap = self._overdue_at.get(priority)
        if not heap:
            return []
        keep: list[tuple[float, float, int, str]] = []
        while heap and heap[0][0] <= now:
            item = heapq.heappop(heap)
            q = self._queued.get(item[3])
            if q is not None and q.seq == item[2]:
                keep.append(item)
        for item in keep:  # still queued until the dispatcher places them
            heapq.heappush(heap, item)
        return [item[3] for item in sorted(keep, key=lambda i: (i[1], i[2]))]

    def _best_matches(self, priority: int, slots: Mapping[str, int], taken: set[str], budget: int) -> list[str]:
        picks: list[str] = []
        popped: list[tuple[_LazyHeap, _Entry]] = []
        remaining = dict(slots)
        whole = self._whole.get(priority)
        try:
            while budget > 0 and remaining:
                progressed = False
                for replica_id in sorted(remaining):
                    best = self._pop_best(priority, replica_id, whole, taken, popped)
                    if best is None:
                        return picks
                    picks.append(best)
                    taken.add(best)
                    budget -= 1
                    progressed = True
                    remaining[replica_id] -= 1
                    if not remaining[replica_id]:
                        del remaining[replica_id]
                    if budget <= 0:
                        break
                if not progressed:
                    break
            return picks
        finally:
            # a pick stays queued until the policy places it: its entries go back
            for heap, entry in popped:
                heap.push(entry)

    def _pop_best(self, priority: int, replica_id: str, whole: _LazyHeap | None, taken: set[str],
                  popped: list[tuple[_LazyHeap, _Entry]]) -> str | None:
        """The request with the smallest key on ``replica_id`` not ``taken``; its entry is
        popped (and recorded in ``popped`` to be pushed back)."""
        mine = self._by_replica.get((priority, replica_id))
        while True:
            a = self._clean_top(mine, replica_id, taken, popped)
            b = self._clean_top(whole, None, taken, popped)
            if a is None and b is None:
                return None
            if b is None or (a is not None and a <= b):
                assert mine is not None and a is not None
                entry = mine.pop()
                q = self._queued[entry[3]]
                held = self.cache.match_per_target(q.req.chunk_hashes, [replica_id]).get(replica_id, 0)
                if held != q.held_chunks.get(replica_id, 0):
                    # the cache changed under the record (an eviction, or blocks seen only in
                    # its KV events): re-key it and look again
                    self.corrections += 1
                    if held > 0:
                        q.held_chunks[replica_id] = held
                        mine.push(self._entry(q, replica_id))
                    else:
                        q.held_chunks.pop(replica_id, None)
                    continue
                popped.append((mine, entry))
                self.picks_matched += 1
                return entry[3]
            assert whole is not None and b is not None
            q = self._queued[b[3]]
            held = self.cache.match_per_target(q.req.chunk_hashes, [replica_id]).get(replica_id, 0) \
                if q.req.chunk_hashes else 0
            if held > 0:
                # the replica holds part of it after all (blocks seen only in its KV events):
                # it competes in the replica's own heap with that key
                self.corrections += 1
                q.held_chunks[replica_id] = held
                self._heap(priority, replica_id).push(self._entry(q, replica_id))
                mine = self._by_replica[(priority, replica_id)]
                continue
            entry = whole.pop()
            popped.append((whole, entry))
            return entry[3]

    def _clean_top(self, heap: _LazyHeap | None, replica_id: str | None, taken: set[str],
                   popped: list[tuple[_LazyHeap, _Entry]]) -> _Entry | None:
        """The heap's top live entry of a request not yet taken. Dead entries are dropped;
        live ones of taken requests are set aside to be pushed back."""
        if heap is None:
            return None
        while (top := heap.top()) is not None:
            if not self._live(top, replica_id):
                heap.pop()
            elif top[3] in taken:
                popped.append((heap, heap.pop()))
            else:
                return top
        return None

    def _compact(self, priority: int) -> None:
        members = [q for q in self._queued.values() if q.priority == priority] if self._needs_compaction(priority) else None
        if members is None:
            return
        whole = self._whole.get(priority)
        if whole is not None:
            whole.compact(len(members), {self._entry(q, None) for q in members})
        for (p, rid), heap in self._by_replica.items():
            if p == priority:
                live = {self._entry(q, rid) for q in members if rid in q.held_chunks}
                heap.compact(len(live), live)
        due = self._overdue_at.get(priority)
        if due is not None and len(due) > 2 * len(members) + _COMPACT_SLACK:
            self._overdue_at[priority] = [(self._due(q.req), q.req.arrival, q.seq, q.req.request_id) for q in members]
            heapq.heapify(self._overdue_at[priority])

    def _needs_compaction(self, priority: int) -> bool:
        limit = 2 * len(self._queued) + _COMPACT_SLACK
        whole = self._whole.get(priority)
        if whole is not None and len(whole.entries) > limit:
            return True
        if len(self._overdue_at.get(priority, ())) > limit:
            return True
        return any(len(h.entries) > limit for (p, _), h in self._by_replica.items() if p == priority)

    # ------------------------------------------------------------------ introspection

    def held_chunks(self, request_id: str) -> Mapping[str, int]:
        """The chunks of a queued request's prompt each replica holds, as this discipline
        knows it (for tests and status)."""
        q = self._queued.get(request_id)
        return dict(q.held_chunks) if q is not None else {}

    def stats(self) -> dict[str, int]:
        return {
            "queued": len(self._queued),
            "decisions": self.decisions,
            "picks_matched": self.picks_matched,
            "picks_overdue": self.picks_overdue,
            "corrections": self.corrections,
            "heap_entries": sum(len(h.entries) for h in self._by_replica.values())
            + sum(len(h.entries) for h in self._whole.values()),
        }
