"""The ``elastic`` pair rule (skymesh/routing/pairing/elastic.py): its role plan's moves
against the rules its docstring states, the prices it reads, and the region core applying
its roles to new work."""

from __future__ import annotations

from skymesh.hardware import PROFILES
from skymesh.routing.base import Decision, PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.health import ProbeSample
from skymesh.routing.model import RegionModel
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.pair_registry import make_pair_rule
from skymesh.routing.pairing.base import DecodeCost, KvLinks, PairContext, Role
from skymesh.routing.pairing.elastic import ElasticConductor, ElasticOptions, RolePlan
from skymesh.routing.region import RegionCore
from skymesh.routing.region_actions import SendToReplica
from skymesh.routing.region_settings import RegionSettings
from skymesh.routing.registry import make_policy

H100 = PROFILES["h100-qwen2.5-7b"]
COST = DecodeCost.of_profile(H100)
CAP = 1000  # KV tokens per replica in the plan's own tests
CHUNK = 64


def views(n: int) -> dict[str, ReplicaView]:
    return {f"r{i}": ReplicaView(f"r{i}") for i in range(n)}


def window(plan: RolePlan, priced: int, whole_misses: int = 0, short: int = 0, tag: str = "") -> None:
    """``priced`` requests seen, the first ``whole_misses`` priced past TBT whole and the
    first ``short`` with no decode replica within TBT."""
    for i in range(priced):
        plan.observe(f"{tag}{i}", i < whole_misses, i < short)


def decide(plan: RolePlan, vs: dict[str, ReplicaView], now: float, priced: int = 20, whole_misses: int = 0,
           short: int = 0, configured: dict[str, Role] | None = None) -> dict[str, Role] | None:
    window(plan, priced, whole_misses, short, tag=f"t{now}-")
    return plan.plan(configured or {}, vs, now)


def test_the_plan_waits_for_its_interval_and_enough_requests() -> None:
    plan = RolePlan(ElasticOptions(interval_s=2.0, min_requests=10), CAP)
    vs = views(4)
    assert plan.plan({}, vs, 0.0) is None  # the first call starts the clock
    window(plan, 20, 20)
    assert plan.plan({}, vs, 1.9) is None and plan.k == 0  # interval not passed
    plan2 = RolePlan(ElasticOptions(interval_s=2.0, min_requests=10), CAP)
    plan2.plan({}, vs, 0.0)
    window(plan2, 9, 9)
    assert plan2.plan({}, vs, 5.0) is None and plan2.k == 0  # too few priced
    assert plan.plan({}, vs, 2.0) is not None and plan.k == 1


def test_the_region_splits_only_when_whole_placements_miss_tbt() -> None:
    opts = ElasticOptions(enter_share=0.1)
    vs = views(4)
    chat = RolePlan(opts, CAP)
    chat.plan({}, vs, 0.0)
    assert decide(chat, vs, 2.0, priced=20, whole_misses=1) is None and chat.k == 0  # 5% < 10%
    heavy = RolePlan(opts, CAP)
    heavy.plan({}, vs, 0.0)
    roles = decide(heavy, vs, 2.0, priced=20, whole_misses=2)  # 10%: split
    assert roles is not None and sorted(roles.values()) == ["decode", "prefill", "prefill", "prefill"]
    # the new decode replica is the one with the least prefill ahead
    vs2 = views(4)
    for i, v in enumerate(vs2.values()):
        v.pending_prefill_tokens = 100 * (3 - i) + 1
    third = RolePlan(opts, CAP)
    third.plan({}, vs2, 0.0)
    roles = decide(third, vs2, 2.0, priced=20, whole_misses=20)
    assert roles is not None and roles["r3"] == "decode"
    # the others stay ``both`` when others_prefill_only is off
    mixed = RolePlan(ElasticOptions(others_prefill_only=False), CAP)
    mixed.plan({}, vs, 0.0)
    roles = decide(mixed, vs, 2.0, whole_misses=20)
    assert roles is not None and sorted(roles.values()) == ["both", "both", "both", "decode"]


def split_plan(opts: ElasticOptions, vs: dict[str, ReplicaView]) -> RolePlan:
    plan = RolePlan(opts, CAP)
    plan.plan({}, vs, 0.0)
    assert decide(plan, vs, 2.0, whole_misses=20) is not None and plan.k == 1
    return plan


def test_k_rises_at_once_on_kv_fill_and_on_repeated_shortage_only() -> None:
    opts = ElasticOptions(raise_fill=0.8, short_share=0.1, short_windows=2)
    vs = views(8)
    plan = split_plan(opts, vs)
    (d,) = plan.decode_ids
    vs[d].kv_usage = 0.7
    vs[d].pending_decode_tokens = 50  # 0.75 of its KV: not past 0.8
    assert decide(plan, vs, 4.0, whole_misses=20) is None and plan.k == 1
    vs[d].pending_decode_tokens = 150  # 0.85
    assert decide(plan, vs, 6.0, whole_misses=20) is not None and plan.k == 2
    for rid in plan.decode_ids:
        vs[rid].kv_usage, vs[rid].pending_decode_tokens = 0.4, 0
    # one window short of a decode replica is not enough; two in a row are
    assert decide(plan, vs, 8.0, whole_misses=20, short=2) is None and plan.k == 2
    assert decide(plan, vs, 10.0, whole_misses=20, short=1) is None and plan.k == 2  # 5%: resets
    assert decide(plan, vs, 12.0, whole_misses=20, short=2) is None and plan.k == 2
    roles = decide(plan, vs, 14.0, whole_misses=20, short=2)
    assert roles is not None and plan.k == 3 and list(roles.values()).count("decode") == 3
    # never past max_decode_share of the pool (half of 8)
    for t in range(8, 30, 1):
        for rid in plan.decode_ids:
            vs[rid].kv_usage = 0.95
        decide(plan, vs, 2.0 * t, whole_misses=20)
    assert plan.k == 4


def test_k_steps_down_only_after_leave_windows_in_a_row() -> None:
    opts = ElasticOptions(leave_share=0.05, leave_windows=3, lower_fill=0.5, raise_fill=0.9)
    vs = views(8)
    plan = split_plan(opts, vs)
    vs[plan.decode_ids[0]].kv_usage = 0.95
    decide(plan, vs, 4.0, whole_misses=20)
    assert plan.k == 2
    # KV that k - 1 would hold at 0.6 of its capacity: no step down
    for rid in plan.decode_ids:
        vs[rid].kv_usage = 0.3
    for t in range(3, 8):
        assert decide(plan, vs, 2.0 * t, whole_misses=20) is None
    assert plan.k == 2
    # at 0.4 it would: after three calm windows in a row (a short window resets the count)
    for rid in plan.decode_ids:
        vs[rid].kv_usage = 0.2
    assert decide(plan, vs, 16.0, whole_misses=20) is None
    assert decide(plan, vs, 18.0, whole_misses=20, short=1) is None
    assert decide(plan, vs, 20.0, whole_misses=20) is None
    assert decide(plan, vs, 22.0, whole_misses=20) is None
    roles = decide(plan, vs, 24.0, whole_misses=20)
    assert roles is not None and plan.k == 1
    # whole placements that would meet TBT, three windows in a row: back to aggregated
    assert decide(plan, vs, 26.0, whole_misses=0) is None
    assert decide(plan, vs, 28.0, whole_misses=0) is None
    roles = decide(plan, vs, 30.0, whole_misses=0)
    assert roles == {rid: "both" for rid in vs} and plan.k == 0


def test_configured_roles_are_kept_and_a_request_priced_again_counts_once() -> None:
    vs = views(4)
    configured: dict[str, Role] = {"r0": "prefill", "r1": "decode"}
    plan = RolePlan(ElasticOptions(min_requests=10), CAP)
    plan.plan(configured, vs, 0.0)
    for _ in range(5):  # one request queued and priced again five times
        plan.observe("same", True, True)
    assert plan.window.priced == 1
    roles = decide(plan, vs, 2.0, whole_misses=20, configured=configured)
    assert roles is not None
    assert (roles["r0"], roles["r1"]) == ("prefill", "decode")
    assert sorted((roles["r2"], roles["r3"])) == ["decode", "prefill"]
    # one replica configured ``both``: nothing to plan, k stays 0
    lone = RolePlan(ElasticOptions(), CAP)
    lone.plan({"r0": "prefill", "r1": "decode", "r2": "decode"}, vs, 0.0)
    decide(lone, vs, 2.0, whole_misses=20, configured={"r0": "prefill", "r1": "decode", "r2": "decode"})
    assert lone.k == 0


def test_a_lost_decode_replica_is_replaced_at_once_not_at_the_next_decision() -> None:
    vs = views(4)
    plan = RolePlan(ElasticOptions(interval_s=2.0, min_requests=10), CAP)
    plan.plan({}, vs, 0.0)
    roles = decide(plan, vs, 2.0, whole_misses=20)
    assert roles is not None and plan.k == 1
    (down,) = plan.decode_ids
    vs[down].healthy = False
    others = [rid for rid in vs if rid != down]
    vs[others[0]].pending_prefill_tokens = 5000  # the other two have less prefill ahead
    # 0.1 s later, with no request priced since: the plan does not wait for its interval
    roles = plan.plan({}, vs, 2.1)
    assert roles is not None and plan.k == 1
    (new,) = plan.decode_ids
    assert new != down and vs[new].healthy and new != others[0]
    assert roles[new] == "decode" and roles[down] == "prefill"  # back in the pool (it takes nothing while down)
    assert plan.plan({}, vs, 2.2) is None  # replaced once; the interval's decision stands at 2.0
    # every replica but the lost one's stand-in down: the decode side is empty, not a dead one
    for rid in vs:
        if rid != new:
            vs[rid].healthy = False
    vs[new].healthy = False
    roles = plan.plan({}, vs, 2.3)
    assert roles is not None and plan.k == 0 and all(r == "both" for r in roles.values())


def model() -> RegionModel:
    per_token, fixed = H100.ttft_seed()
    return RegionModel(chunk_tokens=CHUNK, prefill_s_per_token=per_token, first_token_fixed_s=max(fixed, 0.01))


def request(i: int, prompt: int, out: int) -> RoutingRequest:
    chunks = tuple(10_000 * i + k for k in range(-(-prompt // CHUNK)))
    return RoutingRequest(f"q{i}", chunks, prompt, 0.0, max_tokens=out)


def test_the_rule_counts_what_its_prices_say() -> None:
    ctx = PairContext(model=model(), cost=COST, links=KvLinks(), ttft_slo_s=5.0, tbt_slo_s=0.05)
    rule = ElasticConductor(ElasticOptions(), ctx)
    roles: dict[str, Role] = {"p": "both", "d": "both"}
    p = ReplicaView("p", num_running=4, pending_prefill_tokens=200_000)
    d = ReplicaView("d", num_running=4)
    choice = rule.choose(request(0, 4000, 300), Decision("p"), {"p": p, "d": d}, roles, set(), 100.0)
    assert choice is not None and choice.split  # whole on p misses TBT
    p.pending_prefill_tokens = 0
    choice = rule.choose(request(1, 4000, 300), Decision("p"), {"p": p, "d": d}, roles, set(), 100.0)
    assert choice is not None and not choice.split
    # p prefill-only: its whole price is still read (p's backlog again), though not offered
    p.pending_prefill_tokens = 200_000
    roles["p"] = "prefill"
    rule.choose(request(2, 4000, 300), Decision("p"), {"p": p, "d": d}, roles, set(), 100.0)
    # no replica may decode: the request waits, and was short of a decode replica
    assert rule.choose(request(3, 4000, 300), Decision("p"), {"p": p, "d": d}, roles, {"d"}, 100.0) is None
    w = rule.plan.window
    assert (w.priced, w.whole_misses_tbt, w.decode_short) == (4, 2, 1)


def test_the_region_core_applies_the_plan_to_new_work_only() -> None:
    m = model()
    core = RegionCore("here", make_policy("least_load", PolicyContext(model=m)), OffloadRouter("here", {}, enabled=False),
                      RegionSettings(), m)
    core.set_replicas([f"r{i}" for i in range(4)], 0.0)
    core.set_roles({})
    ctx = PairContext(model=m, cost=COST, links=KvLinks(), ttft_slo_s=30.0, tbt_slo_s=0.05)
    rule = make_pair_rule("elastic", {"interval_s": 1.0, "min_requests": 2, "enter_share": 0.5}, ctx)
    assert isinstance(rule, ElasticConductor)
    core.local.pair_rule = rule
    busy = ProbeSample(num_running=8)
    for rid in core.view.replicas:
        core.probe(rid, busy, 0.0)
        core.local.replicas[rid].pending_prefill_tokens = 100_000  # every whole placement misses TBT
    whole = []
    for i in range(2):
        core.submit(request(i, 8000, 300), 0.0)
        whole += [a for a in core.tick(0.0) if isinstance(a, SendToReplica)]
    assert whole and core.local.policy.replica_ids == ["r0", "r1", "r2", "r3"]  # type: ignore[attr-defined]
    for rid in core.view.replicas:
        core.probe(rid, busy, 1.0)
    core.submit(request(9, 8000, 300), 1.0)
    (send,) = [a for a in core.tick(1.0) if isinstance(a, SendToReplica)]
    roles = {rid: r["role"] for rid, r in core.view.snapshot()["replicas"].items()}
    assert sorted(roles.values()) == ["decode", "prefill", "prefill", "prefill"]
    (dec,) = [rid for rid, r in roles.items() if r == "decode"]
    assert dec not in core.local.policy.replica_ids  # type: ignore[attr-defined]
    assert core.view.heartbeat(1.0).replicas_total == 3  # a new request may start on 3
    assert send.replica_id != dec and send.decision.decode_replica_id == dec
    # what was placed before runs on: its bookings are untouched
    assert sum(core.local.replicas[s.replica_id].in_flight for s in whole) >= 1
