"""The queue's service-rate estimator on its own (skymesh/routing/drain_rate.py): fed
placements and the end of each backlog, asked with ``now``."""

from __future__ import annotations

import pytest

from skymesh.routing.drain_rate import MIN_FIRST_TOKEN_S, MIN_RATE_HISTORY_S, DrainRate


class FakeQueue:
    """A queue whose length and prefill the test sets; its replicas take ``budget`` per
    first token, ``replicas`` of them."""

    def __init__(self, replicas: int = 2, budget: int = 2) -> None:
        self.dispatch_budget = budget
        self.replicas = replicas
        self.length = 0
        self.prefill_tokens = 0

    @property
    def queue_length(self) -> int:
        return self.length

    def queued_prefill_tokens(self) -> int:
        return self.prefill_tokens

    def sustainable_dispatch_rate(self, now: float, first_token_s: float) -> float:
        return self.replicas * self.dispatch_budget / first_token_s


class FixedPrices:
    prefill_s_per_token = 1e-4
    first_token_fixed_s = 0.05


def steady_backlog(rate: DrainRate, queue: FakeQueue, start: float, seconds: float, per_s: float) -> float:
    """Placements at ``per_s`` while the queue stays non-empty; returns the last time."""
    queue.length = 5
    now = start
    for i in range(int(seconds * per_s)):
        now = start + i / per_s
        rate.placed(now)
    return now


def test_no_rate_before_the_region_has_history() -> None:
    queue = FakeQueue()
    rate = DrainRate(queue, FixedPrices())
    assert rate.service_rate_per_s(0.0) is None and rate.expected_queue_wait_s(0.0) is None
    rate.placed(0.0)
    assert rate.service_rate_per_s(MIN_RATE_HISTORY_S / 2) is None


def test_a_backlog_with_history_is_measured_by_its_placements() -> None:
    queue = FakeQueue()
    rate = DrainRate(queue, FixedPrices())
    now = steady_backlog(rate, queue, 0.0, 20.0, 10.0)
    measured = rate.service_rate_per_s(now)
    assert measured == rate.placement_rate(now)
    assert measured == pytest.approx(10.0, rel=0.1)
    assert rate.expected_queue_wait_s(now) == pytest.approx((queue.length + 1) / measured)


def test_a_quiet_spell_never_lowers_the_rate_to_nearly_zero() -> None:
    queue = FakeQueue(replicas=3, budget=2)
    rate = DrainRate(queue, FixedPrices())
    now = steady_backlog(rate, queue, 0.0, 10.0, 10.0)
    queue.length = 0
    rate.end_backlog_if_drained()  # the queue emptied: that backlog is over
    now += 90.0  # nothing arrives for 90 s
    queue.length = 30  # then a burst, before any placement
    assert rate.placement_rate(now) is None  # nothing measured of this backlog yet
    capacity = queue.replicas * queue.dispatch_budget / rate.first_token_s()
    assert rate.service_rate_per_s(now) == capacity  # the replicas' capacity stands in
    wait = rate.expected_queue_wait_s(now)
    assert wait is not None and wait < 1.0


def test_a_backlog_still_queued_keeps_its_measured_rate() -> None:
    queue = FakeQueue()
    rate = DrainRate(queue, FixedPrices())
    now = steady_backlog(rate, queue, 0.0, 10.0, 10.0)
    rate.end_backlog_if_drained()  # the queue is not empty: nothing ends
    assert rate.placement_rate(now) is not None


def test_the_first_token_time_prices_a_typical_queued_prompt_and_never_drops_to_zero() -> None:
    queue = FakeQueue(budget=2)
    rate = DrainRate(queue, FixedPrices())
    assert rate.first_token_s() == FixedPrices.first_token_fixed_s  # empty queue
    queue.length, queue.prefill_tokens = 4, 4000  # 1000 tokens a request, 2 per budget
    assert rate.first_token_s() == pytest.approx(0.05 + 1e-4 * 2 * 1000)

    class Free:
        prefill_s_per_token = 0.0
        first_token_fixed_s = 0.0

    assert DrainRate(FakeQueue(), Free()).first_token_s() == MIN_FIRST_TOKEN_S


def test_offload_keeps_the_observed_rate_where_admission_falls_back_on_the_model() -> None:
    # replicas that drain 40 a second from their caches, while the model (every prompt's
    # full prefill) says they take 2 x 2 / (0.05 + 1e-4 * 2 * 4000) = 4.7 a second
    queue = FakeQueue(replicas=2, budget=2)
    queue.prefill_tokens = 5 * 4000
    rate = DrainRate(queue, FixedPrices())
    now = steady_backlog(rate, queue, 0.0, 20.0, 40.0)
    assert rate.offload_rate_per_s(now) == pytest.approx(40.0, rel=0.05)
    # the queue empties for a moment and refills: the backlog is over for admission
    queue.length, queue.prefill_tokens = 0, 0
    rate.end_backlog_if_drained()
    queue.length, queue.prefill_tokens = 5, 5 * 4000
    model = queue.sustainable_dispatch_rate(now, rate.first_token_s())
    assert model == pytest.approx(2 * 2 / 0.85)
    assert rate.service_rate_per_s(now + 0.1) == pytest.approx(model)  # admission: the model's floor
    # offload still prices the wait here at what the replicas were seen to take
    assert rate.offload_rate_per_s(now + 0.1) == pytest.approx(40.0, rel=0.05)


def test_offload_rate_after_a_quiet_spell_is_floored_by_the_model() -> None:
    queue = FakeQueue(replicas=2, budget=2)
    queue.prefill_tokens = 5 * 1000
    rate = DrainRate(queue, FixedPrices())
    now = steady_backlog(rate, queue, 0.0, 10.0, 10.0)
    queue.length, queue.prefill_tokens = 0, 0
    rate.end_backlog_if_drained()
    observed = rate.observed_rate(now + 90.0)
    assert observed is not None and observed < 0.01  # decayed while nothing came
    queue.length, queue.prefill_tokens = 5, 5 * 1000
    floor = queue.sustainable_dispatch_rate(now + 90.0, rate.first_token_s())
    assert rate.offload_rate_per_s(now + 90.0) == pytest.approx(floor) and floor > 1.0
