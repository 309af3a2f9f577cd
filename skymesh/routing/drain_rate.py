"""How fast a region's queue drains: the rates admission, offload and the heartbeat go by.

:class:`DrainRate` is fed the queue's placements and the end of each backlog (the queue
empty again) and asked, with ``now``, for requests per second. Two rates, for two uses:

- :meth:`DrainRate.service_rate_per_s`, admission's (the queue-wait refusal, early
  rejection): while a backlog has history it measures what the replicas take (an
  exponentially decayed placement rate); before that it falls back on what the healthy
  replicas can at least take by the TTFT model. A quiet spell ends the backlog instead of
  decaying the rate, so an idle region never looks like one whose replicas stopped
  draining, and never refuses its morning.
- :meth:`DrainRate.offload_rate_per_s`, offload's (the predicted-TTFT trigger's wait here,
  and the heartbeat's rate peers price a forward's wait there with): the placements over
  the region's life, never reset, floored by the same capacity. The model's capacity
  prices every prompt's full prefill, and a backlog measured from its first second knows
  little; priced with either, a region with high prefix reuse thought its queue slow,
  forwarded what its own replicas would have served from cache and lost the hits
  (issue 36, docs/benchmarks.md "Offload's rate vs admission's": on a held-out day at
  x5, attainment 0.566 -> 0.746 once a peer's forward no longer counted as restricted).
"""

from __future__ import annotations

import math
from typing import Protocol

# time constant of the placement-rate average: long enough to ride out one probe interval's
# burst, short enough to follow a replica leaving
PLACEMENT_RATE_TAU_S = 5.0
# no early rejection before placements were seen over this long (in the region's life, and
# for the measured rate, in the current backlog): a burst's first probe round is no
# measure of how fast the queue drains
MIN_RATE_HISTORY_S = 1.0
# no replica gives a dispatched request's first token back sooner than this, whatever the
# TTFT model says of an empty prompt (bounds the capacity-derived service rate)
MIN_FIRST_TOKEN_S = 1e-3


class DrainingQueue(Protocol):
    """The queue's read side the estimator needs (:class:`~skymesh.routing.dispatcher.BalancerCore`)."""

    @property
    def dispatch_budget(self) -> int: ...

    @property
    def queue_length(self) -> int: ...

    def queued_prefill_tokens(self) -> int: ...

    def sustainable_dispatch_rate(self, now: float, first_token_s: float) -> float: ...


class FirstTokenPrices(Protocol):
    """The TTFT model's two terms (:class:`~skymesh.routing.offload.OffloadRouter` reads them
    from the region's model)."""

    @property
    def prefill_s_per_token(self) -> float: ...

    @property
    def first_token_fixed_s(self) -> float: ...


def _recent_average(rate: float, rate_at: float, first: float | None, now: float) -> float | None:
    """A placement rate kept as an exponentially decayed sum (``rate`` as of ``rate_at``),
    read at ``now``: requests per second; None with less than ``MIN_RATE_HISTORY_S`` of
    history since ``first`` (or none), or no placement in it."""
    if first is None or now - first < MIN_RATE_HISTORY_S:
        return None
    decayed = rate * math.exp(-(now - rate_at) / PLACEMENT_RATE_TAU_S)
    # an average started at zero is low by this factor until it has tau of history
    average = decayed / (1.0 - math.exp(-(now - first) / PLACEMENT_RATE_TAU_S))
    return average if average > 0.0 else None


class DrainRate:
    """The queue's service rate: placements per second over the current backlog, else the
    replicas' capacity by the TTFT model."""

    __slots__ = ("_queue", "_prices", "_rate", "_rate_at", "_backlog_first_at", "_first_at",
                 "_life_rate", "_life_rate_at")

    def __init__(self, queue: DrainingQueue, prices: FirstTokenPrices) -> None:
        self._queue = queue
        self._prices = prices
        # placements per second over the current backlog (the queue not empty since its
        # first placement), exponentially decayed (time constant PLACEMENT_RATE_TAU_S): how
        # fast the queue drains while the replicas, not the arrivals, limit it
        self._rate = 0.0
        self._rate_at = float("-inf")
        self._backlog_first_at: float | None = None
        self._first_at: float | None = None  # in the region's life
        # placements per second over the region's life, decayed the same way but never
        # reset: what the replicas took of what came, under the cache mix it came with
        self._life_rate = 0.0
        self._life_rate_at = float("-inf")

    def placed(self, now: float) -> None:
        """A queued request was placed (on a replica here) at ``now``."""
        if self._first_at is None:
            self._first_at = now
        if self._backlog_first_at is None:
            self._backlog_first_at = now
        decay = math.exp(-(now - self._rate_at) / PLACEMENT_RATE_TAU_S)
        self._rate = self._rate * decay + 1.0 / PLACEMENT_RATE_TAU_S
        self._rate_at = now
        life_decay = math.exp(-(now - self._life_rate_at) / PLACEMENT_RATE_TAU_S)
        self._life_rate = self._life_rate * life_decay + 1.0 / PLACEMENT_RATE_TAU_S
        self._life_rate_at = now

    def end_backlog_if_drained(self) -> None:
        """The queue is empty: the backlog the placement rate measured is over. What was
        placed while requests arrived slower than the replicas take them measures the
        arrivals, and a quiet spell measures nothing, so the next backlog is measured
        afresh (until then the replicas' capacity stands in)."""
        if self._queue.queue_length == 0 and self._backlog_first_at is not None:
            self._rate = 0.0
            self._rate_at = float("-inf")
            self._backlog_first_at = None

    def placement_rate(self, now: float) -> float | None:
        """Placements per second over the current backlog, recent average; None while
        the backlog has too little history to go by."""
        return _recent_average(self._rate, self._rate_at, self._backlog_first_at, now)

    def observed_rate(self, now: float) -> float | None:
        """Placements per second over the region's life, recent average (backlog or not,
        decayed while idle); None before ``MIN_RATE_HISTORY_S`` of placements."""
        return _recent_average(self._life_rate, self._life_rate_at, self._first_at, now)

    def first_token_s(self) -> float:
        """How long a replica takes, by the TTFT model, to give back a unit of its dispatch
        budget (a dispatched request's first token) while the queue keeps its budget full:
        the fixed part of a first token plus the prefill of a typical queued prompt and of
        the others its budget holds ahead of it."""
        queue = self._queue
        queued = queue.queue_length
        typical_tokens = queue.queued_prefill_tokens() / queued if queued else 0.0
        prefill = self._prices.prefill_s_per_token * queue.dispatch_budget * typical_tokens
        return max(MIN_FIRST_TOKEN_S, self._prices.first_token_fixed_s + prefill)

    def service_rate_per_s(self, now: float) -> float | None:
        """How fast the queue drains, in requests per second: the placement rate
        measured over the current backlog once it has history; before that (a quiet
        region, a fresh burst) what the healthy replicas can at least take
        (``sustainable_dispatch_rate``: their dispatch budgets per predicted first
        token), never a rate that decayed while nothing arrived. None until the region
        has placed requests for ``MIN_RATE_HISTORY_S`` (it never judges replicas it has
        not seen take work), or when nothing says the queue drains at all (every replica
        saturated, no backlog measured yet)."""
        first = self._first_at
        if first is None or now - first < MIN_RATE_HISTORY_S:
            return None
        measured = self.placement_rate(now)
        if measured is not None:
            return measured
        capacity = self._queue.sustainable_dispatch_rate(now, self.first_token_s())
        return capacity if capacity > 0.0 else None

    def offload_rate_per_s(self, now: float) -> float | None:
        """The rate offload prices a queued request's wait here with, and peers are told
        (the heartbeat): what the replicas have been taking (:meth:`observed_rate`, which
        prefix hits speed up as they do), never below what the healthy replicas can at
        least take by the TTFT model (after a quiet spell the observed rate has decayed;
        the model's floor leaves the cache out, so busy replicas drain faster than it
        says). None until the region has placed requests for ``MIN_RATE_HISTORY_S``."""
        observed = self.observed_rate(now)
        if observed is None:
            return None
        capacity = self._queue.sustainable_dispatch_rate(now, self.first_token_s())
        return max(observed, capacity)

    def has_offload_rate(self, now: float) -> bool:
        """:meth:`offload_rate_per_s` is not None now (the capacity it is floored by is
        not computed)."""
        return self.observed_rate(now) is not None

    def expected_queue_wait_s(self, now: float) -> float | None:
        """How long a request queued now would wait for its placement, at the service
        rate; None while there is too little history to go by."""
        rate = self.service_rate_per_s(now)
        return None if rate is None else (self._queue.queue_length + 1) / rate
