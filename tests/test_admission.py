"""The admission list: the rules a region checks, in order, before it queues a request."""

from __future__ import annotations

from dataclasses import dataclass

from skymesh.routing.admission.base import AdmissionRule, Refusal, RegionView, first_refusal
from skymesh.routing.admission.no_capacity import NoCapacityRule
from skymesh.routing.admission.queue_wait import QueueWaitRule
from skymesh.routing.admission.rules import admission_rules
from skymesh.routing.admission.slo_unreachable import SloUnreachableRule
from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.region import RegionCore
from skymesh.routing.region_settings import RegionSettings
from skymesh.routing.registry import make_policy


@dataclass
class FakeRegion:
    queue_length: int = 0
    rate: float | None = None
    soonest_here: float | None = None
    soonest_peer: float = float("inf")
    nothing: bool = False

    def service_rate_per_s(self, now: float) -> float | None:
        return self.rate

    def soonest_local_first_token_s(self, req: RoutingRequest, now: float) -> float | None:
        return self.soonest_here

    def soonest_peer_first_token_s(self, req: RoutingRequest, now: float) -> float:
        return self.soonest_peer

    def nothing_can_serve(self, req: RoutingRequest, now: float) -> bool:
        return self.nothing

    def why_nothing_can_serve(self, req: RoutingRequest, now: float) -> str:
        return "nothing it may use is up"


def req(slo_ttft_s: float | None = None, priority: int = 0) -> RoutingRequest:
    return RoutingRequest("q0", (), 16, 0.0, slo_ttft_s=slo_ttft_s, priority=priority)


def codes(rules: tuple[AdmissionRule, ...], region: RegionView, r: RoutingRequest) -> str | None:
    refusal = first_refusal(rules, r, 0.0, region)
    return None if refusal is None else refusal.code


def test_the_list_is_built_in_its_order_from_the_settings() -> None:
    kinds = [type(r) for r in admission_rules(RegionSettings())]
    assert kinds == [NoCapacityRule, QueueWaitRule, SloUnreachableRule]
    off = admission_rules(RegionSettings(max_queue_wait_s=None, early_rejection=False))
    assert [type(r) for r in off] == [NoCapacityRule]


def test_the_first_refusal_in_order_is_the_answer() -> None:
    rules = admission_rules(RegionSettings(max_queue_wait_s=10.0, retry_after_s=2.0))
    # every rule would refuse: no capacity comes first
    everything_wrong = FakeRegion(queue_length=99, rate=1.0, soonest_here=50.0, nothing=True)
    assert codes(rules, everything_wrong, req(slo_ttft_s=1.0)) == "no_capacity"
    # then the queue wait, before the SLO
    everything_wrong.nothing = False
    refusal = first_refusal(rules, req(slo_ttft_s=1.0), 0.0, everything_wrong)
    assert refusal == Refusal(429, "queue_wait", "the balancer's queue would take ~100 s to reach this request "
                              "(bound 10 s)", 10.0)
    everything_wrong.queue_length = 0
    assert codes(rules, everything_wrong, req(slo_ttft_s=1.0)) == "slo_unreachable"
    assert codes(rules, everything_wrong, req()) is None  # no target of its own


def test_queue_wait_retry_after_is_the_drain_to_the_bound_capped_by_the_bound() -> None:
    rule = QueueWaitRule(max_queue_wait_s=10.0, retry_after_s=2.0)
    refusal = rule.check(req(), 0.0, FakeRegion(queue_length=11, rate=1.0))
    assert refusal is not None and refusal.retry_after_s == 4.0  # 12 s expected - 10 + 2
    assert rule.check(req(), 0.0, FakeRegion(queue_length=9, rate=1.0)) is None  # 10 s: within the bound
    assert rule.check(req(), 0.0, FakeRegion(queue_length=99, rate=None)) is None  # no rate: never blind


def test_a_peer_that_meets_the_target_saves_the_request() -> None:
    rule = SloUnreachableRule(retry_after_s=2.0)
    assert rule.check(req(slo_ttft_s=1.0), 0.0, FakeRegion(soonest_here=5.0, soonest_peer=0.5)) is None
    refusal = rule.check(req(slo_ttft_s=1.0), 0.0, FakeRegion(soonest_here=5.0, soonest_peer=4.0))
    assert refusal is not None and refusal.retry_after_s == 3.0


@dataclass(frozen=True)
class LowPriorityWhileQueued:
    """A custom rule, one class: no priority below zero while anything is queued."""

    def check(self, r: RoutingRequest, now: float, region: RegionView) -> Refusal | None:
        if r.priority < 0 and region.queue_length:
            return Refusal(429, "low_priority", "busy: come back later", 1.0)
        return None


def test_a_custom_rule_is_one_class_in_the_list() -> None:
    rules = (*admission_rules(RegionSettings()), LowPriorityWhileQueued())
    busy = FakeRegion(queue_length=3)
    assert codes(rules, busy, req(priority=-1)) == "low_priority"
    assert codes(rules, busy, req(priority=0)) is None
    assert codes(rules, FakeRegion(nothing=True), req(priority=-1)) == "no_capacity"  # earlier rules first


def test_the_region_core_rebuilds_its_list_on_reconfigure() -> None:
    core = RegionCore("here", make_policy("least_load", PolicyContext()), OffloadRouter("here", {}, enabled=False))
    assert [type(r) for r in core.admission] == [NoCapacityRule, QueueWaitRule, SloUnreachableRule]
    core.reconfigure(RegionSettings(early_rejection=False), allowed=lambda a, b: True, max_remote_queue=8,
                     miss_limit=3)
    assert [type(r) for r in core.admission] == [NoCapacityRule, QueueWaitRule]
