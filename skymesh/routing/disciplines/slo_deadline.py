"""The ``slo`` queue discipline (SLO-aware scheduling), pure: no clock (``now`` is passed
in), randomness from a seeded generator the discipline owns.

The head ``window`` of each priority's queue is ordered to maximise how many meet their
TTFT deadline (arrival + their class's TTFT target, else the configured SLO), then to
minimise their total time to first token, under a latency predictor: list scheduling of
the window, in the order tried, onto the replicas as each frees (its prefill ahead, from
the balancer's pending prefill tokens), each request taking its own prefill (its prompt,
at the region's refitted cost per token). The search is simulated annealing over the order
(swap and move-one steps, geometric cooling) from the earliest-deadline-first order,
bounded by ``iterations`` evaluations per decision, then polished by moving one request or
swapping two while that helps (at most two sweeps, and ``iterations`` evaluations more);
the best order seen is kept, so whatever the budget the answer is EDF or better. A head
whose members and order did not change since its last decision is not searched again (a
new arrival in the window, or a placement, starts a new search). Starvation bound: a
request queued ``max_age_s`` or longer goes first, in arrival order.

Why by hand: no maintained library anneals a permutation under a custom cost in a few
hundred microseconds; the loop is twenty lines.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Self

from skymesh.routing.base import ReplicaView, RoutingRequest
from skymesh.routing.disciplines.base import (
    DEFAULT_MAX_AGE_S,
    DisciplineContext,
    DisciplineOptions,
    QueueDiscipline,
)
from skymesh.routing.queueing import PriorityQueue

# evaluations per decision: ~0.5 ms p50 / 0.9 ms p99 for a head of 8 on the development
# machine, within 1% of the exhaustive optimum on 98% of such heads (benchmarks/slo_order.py)
DEFAULT_ITERATIONS = 100
# how many requests at the head of each priority are ordered
DEFAULT_WINDOW = 8


@dataclass(frozen=True, slots=True)
class SloDeadlineOptions(DisciplineOptions):
    """The ``slo`` discipline's options (the config's ``queue.window``, ``queue.iterations``,
    ``queue.max_age_s``)."""

    window: int = DEFAULT_WINDOW
    iterations: int = DEFAULT_ITERATIONS  # schedule evaluations per decision
    max_age_s: float = DEFAULT_MAX_AGE_S  # the starvation bound


@dataclass(frozen=True, slots=True)
class Candidate:
    request_id: str
    deadline: float  # absolute time its first token is due
    arrival: float
    prefill_s: float  # its own prefill


def schedule_cost(order: Sequence[Candidate], free_at: Sequence[float], now: float) -> tuple[int, float]:
    """(misses, total TTFT) of serving ``order`` by list scheduling: each request, in turn,
    starts on the replica that frees first (``free_at``: seconds from now) and holds it for
    its prefill."""
    return _cost(range(len(order)), [c.prefill_s for c in order], [c.deadline - now for c in order],
                 [now - c.arrival for c in order], list(free_at))


def _cost(order: Iterable[int], prefill: Sequence[float], due_in: Sequence[float], age: Sequence[float],
          free_at: list[float]) -> tuple[int, float]:
    # times relative to now: request k's first token comes at (its start + its prefill), its
    # TTFT is that plus its age, and it misses when that is past due_in[k]
    misses = 0
    total = 0.0
    if len(free_at) <= 1:  # one replica free next: a running sum, no heap
        t = free_at[0] if free_at else 0.0
        for k in order:
            t += prefill[k]
            total += t + age[k]
            if t > due_in[k]:
                misses += 1
        return misses, total
    heap = list(free_at)
    heapq.heapify(heap)
    for k in order:
        t = heap[0] + prefill[k]
        heapq.heapreplace(heap, t)
        total += t + age[k]
        if t > due_in[k]:
            misses += 1
    return misses, total


def anneal(cands: Sequence[Candidate], free_at: Sequence[float], now: float, iterations: int,
           rng: random.Random) -> list[Candidate]:
    """The order found: earliest deadline first, then ``iterations`` annealing steps (swap
    or move one request; the best order seen is kept, so the result is never worse than
    EDF), then polished (:func:`_descend`)."""
    edf = sorted(cands, key=lambda c: (c.deadline, c.arrival, c.request_id))
    n = len(edf)
    if n < 2 or iterations <= 0:
        return edf
    prefill = [c.prefill_s for c in edf]
    due_in = [c.deadline - now for c in edf]
    age = [now - c.arrival for c in edf]
    free = sorted(free_at)
    # one request can move the window's total TTFT by at most n x its whole prefill, so a
    # miss weighing more than that makes "fewer misses" come first whatever the latencies
    miss_weight = max(16, n) * sum(prefill) + 1e-6

    def energy(order: list[int]) -> float:
        misses, total = _cost(order, prefill, due_in, age, free)
        return misses * miss_weight + total

    order = list(range(n))
    cur = best = energy(order)
    best_order = order
    # warm enough at first to pass through an extra miss on the way to fewer
    t = 0.5 * miss_weight
    cooling = 1e-4 ** (1.0 / iterations)
    rand = rng.random
    for _ in range(iterations):
        i = int(rand() * n)
        j = int(rand() * (n - 1))
        j += j >= i  # two distinct positions
        new = order[:]
        if rand() < 0.5:
            new.insert(j, new.pop(i))
        else:
            new[i], new[j] = new[j], new[i]
        e = energy(new)
        if e <= cur or rand() < math.exp((cur - e) / t):
            order, cur = new, e
            if e < best:
                best, best_order = e, new
        t *= cooling
    return [edf[k] for k in _descend(best_order, best, energy, iterations)]


def _descend(order: list[int], e: float, energy: Callable[[list[int]], float], budget: int,
             passes: int = 2) -> list[int]:
    """Polish: move one request or swap two while that helps (first improvement), at most
    ``passes`` sweeps of every such step and ``budget`` evaluations."""
    n = len(order)
    for _ in range(passes):
        improved = False
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                for swap in (False, True):
                    if swap and j < i:
                        continue  # the same pair as (j, i)
                    new = order[:]
                    if swap:
                        new[i], new[j] = new[j], new[i]
                    else:
                        new.insert(j, new.pop(i))
                    if budget <= 0:
                        return order
                    budget -= 1
                    e_new = energy(new)
                    if e_new < e:
                        order, e, improved = new, e_new, True
        if not improved:
            break
    return order


class SloDeadlineOrder(QueueDiscipline):
    """The ``slo`` discipline (see the module docstring). The head window is read anew at
    every decision, so queue events need no bookkeeping here: only the order is its own."""

    def __init__(self, *, window: int, iterations: int, default_slo_s: float,
                 prefill_s: Callable[[int], float], max_age_s: float, seed: int = 0) -> None:
        self.window = window
        self.iterations = iterations
        self.default_slo_s = default_slo_s
        # the starvation bound: a request waiting this long goes first, in arrival order,
        # whatever the search would prefer (one that already missed its deadline counts
        # as a miss wherever it stands, so nothing else would ever move it forward)
        self.max_age_s = max_age_s
        self.prefill_s = prefill_s  # seconds of prefill for a prompt of n tokens
        self.rng = random.Random(seed)
        self._last: dict[int, tuple[str, ...]] = {}  # priority -> the head it last ordered
        self.decisions = 0

    @classmethod
    def build(cls, options: SloDeadlineOptions, ctx: DisciplineContext) -> Self:
        return cls(window=options.window, iterations=options.iterations, default_slo_s=ctx.default_slo_s,
                   prefill_s=ctx.model.prefill_s, max_age_s=options.max_age_s)

    def dispatch_order(self, queue: PriorityQueue[Any], replicas: Mapping[str, ReplicaView],
                       free_slots: Mapping[str, int], now: float,
                       excluded: Callable[[str], AbstractSet[str]] | None = None) -> list[str]:
        """Each priority's head window put in the order found; the queue in that order."""
        for priority, head in queue.heads(self.window):
            order = self.order_head(priority, [q.req for q in head], replicas, now)
            if order is not None:
                queue.reorder_head(priority, order)
        return queue.ids()

    def stats(self) -> dict[str, int]:
        return {"decisions": self.decisions}

    def order_head(self, priority: int, head: Sequence[RoutingRequest],
                   replicas: Mapping[str, ReplicaView], now: float) -> list[str] | None:
        """The new order of ``head`` (request ids), or None to leave it as it is."""
        ids = tuple(r.request_id for r in head)
        if len(ids) < 2 or self._last.get(priority) == ids:
            return None
        free_at = sorted(
            0.0 if v.available else self.prefill_s(max(0, v.pending_prefill_tokens))
            for v in replicas.values() if v.healthy
        )
        overdue = sorted((r for r in head if now - r.arrival >= self.max_age_s), key=lambda r: (r.arrival, r.request_id))
        pinned = {r.request_id for r in overdue}
        cands = [
            Candidate(r.request_id, r.arrival + (r.slo_ttft_s if r.slo_ttft_s is not None else self.default_slo_s),
                      r.arrival, self.prefill_s(r.prompt_tokens))
            for r in head if r.request_id not in pinned
        ]
        # the overdue ones hold the replicas first: the rest is planned behind them
        for r in overdue:
            free_at[0] += self.prefill_s(r.prompt_tokens) if free_at else 0.0
            free_at.sort()
        order = [r.request_id for r in overdue] + [
            c.request_id for c in anneal(cands, free_at, now, self.iterations, self.rng)]
        self.decisions += 1
        self._last[priority] = tuple(order)
        return None if tuple(order) == ids else order
