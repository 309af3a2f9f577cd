"""The ``prefix`` queue discipline (FEATHER): when a replica frees up, the queued request
that best matches what it already holds goes first. Pure: no clock, no I/O.

A prompt is its vector of cumulative chunk hashes (``RoutingRequest.chunk_hashes``), so
"how much of it does replica p hold" is the length of its longest prefix in p's cache, read
through the same :class:`CacheView` the policies read (the replica's KV-event index while
events flow, else the region's routing history). A request's key on p is what p
would still have to prefill for it: its prompt tokens less the tokens of the chunks p holds
(the *missing chunks*, in tokens, so a partial tail chunk counts as work too). The request
with the smallest key on p is p's best match; among equals, the older one.

Kept incrementally, never by rescanning the queue:

- ``_sharers`` maps a chunk hash to the queued requests whose prompt has it. When this
  balancer sends a request to p, only the chunks p did not hold before are new there; the
  queued requests that share one of them get a better key on p (walked deepest chunk first,
  so each such request is updated once).
- Each request has a *floor*: the chunks of it that most replicas held when it was queued
  (0 for a new prompt; a system prompt cached everywhere counts). One lazy min-heap per
  priority holds every queued request keyed by its floor; one per (priority, replica) holds
  a request only where that replica holds more or less than its floor. The best match on p
  is the smaller of p's top and the shared top among requests not recorded apart for p.
  Memory is the queue plus the (request, replica) pairs that differ from the floor, not
  queue x replicas (a prefix every replica holds costs one entry, not one per replica). An
  entry whose request left, or whose key changed since it was pushed, is skipped when it
  reaches the top; heaps are rebuilt when stale entries outnumber live ones.
- A cache forgets (vLLM evicts blocks, the history trie drops its least recent leaves): an
  entry reaching the top of p's heap is checked against the cache before it is chosen, and
  pushed back with its true key when that differs.

One concern (~500 lines): that incremental index and the order it gives.

The discipline orders, the policy places: :meth:`PrefixMatchOrder.dispatch_order` gives each
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
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Self

from skymesh.routing.base import ReplicaView, RoutingRequest
from skymesh.routing.disciplines.base import (
    DEFAULT_MAX_AGE_S,
    DisciplineContext,
    DisciplineOptions,
    QueueDiscipline,
)
from skymesh.routing.model import RegionModel
from skymesh.routing.queueing import PriorityQueue

# (missing prefill tokens on the replica, arrival, admission sequence, request id)
_Entry = tuple[int, float, int, str]
# a heap is rebuilt from its live entries once it holds this many more than twice them
_COMPACT_SLACK = 64
# why a heap top is passed over: not at all, taken by another replica this round, or not
# for the replica looking now
_KEEP, _TAKEN, _NOT_HERE = 0, 1, 2
# the tail bound, as a share of the request's TTFT target (the one probe behind it:
# docs/benchmarks.md, "Queue order: prefix (FEATHER) vs fcfs")
DEFAULT_PREFIX_TTFT_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class PrefixMatchOptions(DisciplineOptions):
    """The ``prefix`` discipline's options (the config's ``queue.max_age_s`` and
    ``queue.prefix_ttft_share``)."""

    max_age_s: float = DEFAULT_MAX_AGE_S  # the starvation bound
    # also first once waited this share of its TTFT target (its class's, else the balancer's SLO)
    prefix_ttft_share: float = DEFAULT_PREFIX_TTFT_SHARE


@dataclass(slots=True)
class _Queued:
    req: RoutingRequest
    priority: int
    seq: int
    # chunks of this prompt most replicas held when it was queued (a system prompt cached
    # everywhere): the shared heap's key counts them, so they cost no per-replica entry
    floor: int = 0
    # replica -> chunks of this prompt it holds, as last known, where that is not ``floor``
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

    def rebuild(self, live: Callable[[_Entry], bool]) -> None:
        # a set: a request re-keyed back to an earlier key has two equal entries
        self.entries = list({e for e in self.entries if live(e)})
        heapq.heapify(self.entries)


class PrefixMatchOrder(QueueDiscipline):
    """The ``prefix`` discipline (see the module docstring)."""

    def __init__(self, *, model: RegionModel, max_age_s: float, ttft_share: float = 1.0,
                 default_slo_s: float | None = None, records_dispatches: bool = True) -> None:
        self.chunk_tokens = model.chunk_tokens
        self.max_age_s = max_age_s
        self.ttft_share = ttft_share
        self.default_slo_s = default_slo_s
        # the region model's CacheView, the one the policy reads: a replica's KV-event index
        # answers for it while events flow, else the routing history
        self.model = model
        self.cache = model.cache
        # whether this discipline records its dispatches in that history: not when the
        # region core built it (the region records each dispatch once, after the policy)
        self.records_dispatches = records_dispatches
        self.replica_ids: list[str] = []
        self._queued: dict[str, _Queued] = {}
        self._per_priority: Counter[int] = Counter()
        self._sharers: dict[int, set[str]] = {}
        self._by_replica: dict[tuple[int, str], _LazyHeap] = {}
        self._whole: dict[int, _LazyHeap] = {}  # priority -> every request, keyed by its floor
        # priority -> (when it is overdue, arrival, admission sequence, request id)
        self._overdue_at: dict[int, list[tuple[float, float, int, str]]] = {}
        self._seq = 0
        self.decisions = 0
        self.picks_matched = 0  # offers made because a replica held part of the prompt
        self.picks_overdue = 0  # offers made because the request was overdue
        self.corrections = 0  # heap tops the cache held otherwise than recorded (evictions, events)
        self.compactions = 0

    @classmethod
    def build(cls, options: PrefixMatchOptions, ctx: DisciplineContext) -> Self:
        return cls(model=ctx.model, max_age_s=options.max_age_s, ttft_share=options.prefix_ttft_share,
                   default_slo_s=ctx.default_slo_s, records_dispatches=False)

    # ------------------------------------------------------------------ keys

    def _missing(self, q: _Queued, replica_id: str | None) -> int:
        held = q.held_chunks.get(replica_id, q.floor) if replica_id is not None else q.floor
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
        if q is None or q.seq != entry[2]:
            return False
        if replica_id is not None and replica_id not in q.held_chunks:
            return False  # it holds the floor there: the shared heap holds that key
        return entry == self._entry(q, replica_id)

    def _held_now(self, q: _Queued, replica_id: str) -> int:
        if not q.req.chunk_hashes:
            return 0
        return self.cache.match_per_target(q.req.chunk_hashes, [replica_id]).get(replica_id, 0)

    def _set_held(self, q: _Queued, replica_id: str, chunks: int) -> None:
        if chunks != q.floor:
            # above the floor, or below it (an eviction): the replica's own heap has its key,
            # and the shared heap's entry is not offered to this replica
            q.held_chunks[replica_id] = chunks
            self._heap(q.priority, replica_id).push(self._entry(q, replica_id))
        else:
            q.held_chunks.pop(replica_id, None)

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
        self._per_priority[req.priority] += 1
        for h in req.chunk_hashes:
            self._sharers.setdefault(h, set()).add(req.request_id)
        held = (self.cache.match_per_target(req.chunk_hashes, self.replica_ids)
                if req.chunk_hashes and self.replica_ids else {})
        if held:
            # the most common holding (ties: the larger): the fewest replicas recorded apart
            counts = Counter(held.values())
            q.floor = max(counts, key=lambda chunks: (counts[chunks], chunks))
        for rid, chunks in held.items():
            if chunks != q.floor:
                self._set_held(q, rid, chunks)
        whole = self._whole.get(req.priority)
        if whole is None:
            whole = self._whole[req.priority] = _LazyHeap()
        whole.push(self._entry(q, None))
        heapq.heappush(self._overdue_at.setdefault(req.priority, []), (self._due(req), req.arrival, q.seq, req.request_id))

    def _score(self, q: _Queued, replica_ids: Sequence[str]) -> None:
        if not q.req.chunk_hashes or not replica_ids:
            return
        for rid, chunks in self.cache.match_per_target(q.req.chunk_hashes, replica_ids).items():
            self._set_held(q, rid, chunks)

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
        self._per_priority[q.priority] -= 1
        if self._per_priority[q.priority] <= 0:
            # the priority emptied: its heaps hold only dead entries
            del self._per_priority[q.priority]
            self._whole.pop(q.priority, None)
            self._overdue_at.pop(q.priority, None)
            for key in [k for k in self._by_replica if k[0] == q.priority]:
                del self._by_replica[key]

    def on_dispatch(self, req: RoutingRequest, replica_id: str, now: float) -> None:
        """``req`` was sent to ``replica_id``: the chunks it did not hold are there now (a
        replica whose KV events flow says so itself: :meth:`on_cached`)."""
        chunks = req.chunk_hashes
        if not chunks:
            return
        # a replica another source answers for (its KV events) reports its stores itself
        from_history = self.cache.answered_by_history(replica_id)
        before = self.cache.match_per_target(chunks, [replica_id]).get(replica_id, 0) if from_history else 0
        if self.records_dispatches:
            self.model.record_dispatch(req, replica_id, now)
        if not from_history:
            return
        updated: set[str] = set()
        # deepest new chunk first: a queued request sharing it gets its best key at once
        for depth in range(len(chunks), before, -1):
            for rid in self._sharers.get(chunks[depth - 1], ()):
                if rid in updated:
                    continue
                updated.add(rid)
                q = self._queued[rid]
                if q.held_chunks.get(replica_id, q.floor) < depth:
                    self._set_held(q, replica_id, depth)

    def on_cached(self, replica_id: str, chunk_hashes: Iterable[int]) -> None:
        """A replica's KV events stored blocks (``chunk_hashes``, the balancer's own): the
        queued requests sharing one are re-scored there."""
        touched = {rid for h in chunk_hashes for rid in self._sharers.get(h, ())}
        for rid in touched:
            q = self._queued[rid]
            held = self._held_now(q, replica_id)
            if held != q.held_chunks.get(replica_id, q.floor):
                self._set_held(q, replica_id, held)

    # ------------------------------------------------------------------ ordering

    def dispatch_order(self, queue: PriorityQueue[Any], replicas: Mapping[str, ReplicaView],
                       free_slots: Mapping[str, int], now: float,
                       excluded: Callable[[str], AbstractSet[str]] | None = None) -> list[str]:
        """The order in which the dispatcher offers queued requests to the policy: per
        priority (highest first), the overdue ones in arrival order, then each free
        replica's best matches (round-robin over the replicas, as many as its free slots
        left after the higher priorities; a request never for a replica ``excluded`` names
        for it), then the rest in queue order."""
        order: list[str] = []
        slots = {r: n for r, n in free_slots.items() if n > 0}
        for priority, ids in queue.lanes():
            first = self._overdue(priority, now)
            self.picks_overdue += len(first)
            for _ in first:  # placed wherever the policy says: charge the roomiest replica
                if slots:
                    roomiest = max(slots, key=lambda r: (slots[r], r))
                    slots[roomiest] -= 1
                    if not slots[roomiest]:
                        del slots[roomiest]
            taken = set(first)
            if slots:
                picks = self._best_matches(priority, slots, taken, excluded)
                first.extend(picks)
            order.extend(first)
            order.extend(rid for rid in ids if rid not in taken)
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

    def _best_matches(self, priority: int, slots: dict[str, int], taken: set[str],
                      excluded: Callable[[str], AbstractSet[str]] | None) -> list[str]:
        """Each replica with a free slot, in turn, takes its best match not ``taken`` (one a
        round, a slot each); ``slots`` is charged for every pick. Picks of a replica that
        holds part of the prompt come first: a cache-aware policy sends them there, and a
        pick nobody holds, placed by load, then takes what is left."""
        picks: list[str] = []
        unmatched: list[str] = []
        popped: list[tuple[_LazyHeap, _Entry]] = []
        whole = self._whole.get(priority)
        # the round starts at a different replica each decision, so no name always goes first
        names = sorted(slots)
        start = self.decisions % len(names)
        turn = names[start:] + names[:start]
        try:
            while turn:
                still: list[str] = []
                for replica_id in turn:
                    best = self._pop_best(priority, replica_id, whole, taken, excluded, popped)
                    if best is None:
                        continue  # nothing left this replica may take
                    request_id, matched = best
                    (picks if matched else unmatched).append(request_id)
                    taken.add(request_id)
                    slots[replica_id] -= 1
                    if slots[replica_id]:
                        still.append(replica_id)
                    else:
                        del slots[replica_id]
                turn = still
            return picks + unmatched
        finally:
            # a pick stays queued until the policy places it: its entries go back
            for heap, entry in popped:
                heap.push(entry)

    def _pop_best(self, priority: int, replica_id: str, whole: _LazyHeap | None, taken: set[str],
                  excluded: Callable[[str], AbstractSet[str]] | None,
                  popped: list[tuple[_LazyHeap, _Entry]]) -> tuple[str, bool] | None:
        """The request with the smallest key on ``replica_id`` that is not ``taken`` and may
        run there, and whether the replica holds part of it; its entry is popped (and
        recorded in ``popped`` to be pushed back after the round)."""
        # entries passed over for this replica only (excluded here, or recorded apart from
        # the shared key): back in their heaps before the next replica looks
        aside: list[tuple[_LazyHeap, _Entry]] = []

        def skip(request_id: str) -> int:
            if request_id in taken:
                return _TAKEN
            if excluded is not None and replica_id in excluded(request_id):
                return _NOT_HERE
            return _KEEP

        def skip_shared(request_id: str) -> int:
            # the shared key (its floor) is not its key on a replica recorded apart
            why = skip(request_id)
            return _NOT_HERE if why == _KEEP and replica_id in self._queued[request_id].held_chunks else why

        try:
            while True:
                mine = self._by_replica.get((priority, replica_id))
                a = self._clean_top(mine, replica_id, skip, popped, aside)
                b = self._clean_top(whole, None, skip_shared, popped, aside)
                if a is None and b is None:
                    return None
                if b is None or (a is not None and a <= b):
                    assert mine is not None and a is not None
                    q = self._queued[a[3]]
                    held = self._held_now(q, replica_id)
                    if held != q.held_chunks[replica_id]:
                        # the cache changed under the record (an eviction): re-key it, look again
                        self.corrections += 1
                        mine.pop()
                        self._set_held(q, replica_id, held)
                        if replica_id not in q.held_chunks and whole is not None:
                            # back at its floor here: its shared entry, set aside for this
                            # replica while it was recorded apart, competes again
                            self._restore_aside(aside, whole, q.req.request_id)
                        continue
                    popped.append((mine, mine.pop()))
                    self.picks_matched += held > 0
                    return a[3], held > 0
                assert whole is not None
                q = self._queued[b[3]]
                held = self._held_now(q, replica_id)
                if held != q.floor:
                    # the replica holds more of it (blocks seen only in its KV events) or less
                    # (an eviction) than the floor: it competes in the replica's own heap
                    self.corrections += 1
                    self._set_held(q, replica_id, held)
                    continue
                popped.append((whole, whole.pop()))
                self.picks_matched += held > 0
                return b[3], held > 0
        finally:
            for heap, entry in aside:
                heap.push(entry)

    @staticmethod
    def _restore_aside(aside: list[tuple[_LazyHeap, _Entry]], heap: _LazyHeap, request_id: str) -> None:
        """Push ``request_id``'s entries set aside from ``heap`` back into it."""
        keep = []
        for h, entry in aside:
            if h is heap and entry[3] == request_id:
                heap.push(entry)
            else:
                keep.append((h, entry))
        aside[:] = keep

    def _clean_top(self, heap: _LazyHeap | None, replica_id: str | None, skip: Callable[[str], int],
                   popped: list[tuple[_LazyHeap, _Entry]], aside: list[tuple[_LazyHeap, _Entry]]) -> _Entry | None:
        """The heap's top live entry of a request not skipped. Dead entries are dropped;
        live ones skipped are set aside (``popped`` for the round: taken; ``aside`` for this
        replica's look only)."""
        if heap is None:
            return None
        while (top := heap.top()) is not None:
            if not self._live(top, replica_id):
                heap.pop()
                continue
            why = skip(top[3])
            if why == _KEEP:
                return top
            (popped if why == _TAKEN else aside).append((heap, heap.pop()))
        return None

    def _compact(self, priority: int) -> None:
        """Rebuild a heap of ``priority`` from its live entries once it holds more than
        twice the priority's queued requests (and some slack): O(heap), amortised over the
        pushes that made it grow."""
        limit = 2 * self._per_priority[priority] + _COMPACT_SLACK
        whole = self._whole.get(priority)
        if whole is not None and len(whole.entries) > limit:
            whole.rebuild(lambda e: self._live(e, None))
            self.compactions += 1
        for (p, rid), heap in self._by_replica.items():
            if p == priority and len(heap.entries) > limit:
                heap.rebuild(lambda e, r=rid: self._live(e, r))  # type: ignore[misc]
                self.compactions += 1
        due = self._overdue_at.get(priority)
        if due is not None and len(due) > limit:
            live = {(self._due(q.req), q.req.arrival, q.seq, q.req.request_id)
                    for q in self._queued.values() if q.priority == priority}
            self._overdue_at[priority] = [d for d in due if d in live]
            heapq.heapify(self._overdue_at[priority])
            self.compactions += 1

    # ------------------------------------------------------------------ introspection

    def held_chunks(self, request_id: str) -> Mapping[str, int]:
        """The chunks of a queued request's prompt each replica holds, as this discipline
        knows it (for tests and status)."""
        q = self._queued.get(request_id)
        if q is None:
            return {}
        held = {r: q.held_chunks.get(r, q.floor) for r in self.replica_ids}
        return {r: n for r, n in held.items() if n > 0}

    def stats(self) -> dict[str, int]:
        return {
            "queued": len(self._queued),
            "decisions": self.decisions,
            "picks_matched": self.picks_matched,
            "picks_overdue": self.picks_overdue,
            "corrections": self.corrections,
            "compactions": self.compactions,
            "heap_entries": sum(len(h.entries) for h in self._by_replica.values())
            + sum(len(h.entries) for h in self._whole.values())
            + sum(len(h) for h in self._overdue_at.values()),
        }
