"""Prefill/decode pairs (skymesh/routing/pairing): the three pair rules against references
written from their docstrings, the pricing's TBT, the registry, and a split request's two
legs booked and released through the region core."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from skymesh.hardware import PROFILES
from skymesh.routing.assembly import (
    CostSeed,
    OffloadSettings,
    PairingSettings,
    PolicySettings,
    RegionAssembly,
    build_region_core,
)
from skymesh.routing.base import Decision, PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.health import HealthSettings, ProbeSample
from skymesh.routing.model import RegionModel
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.pair_registry import UnknownPairRuleError, make_pair_rule
from skymesh.routing.pairing.always import AlwaysOptions, AlwaysSplit
from skymesh.routing.pairing.base import (
    DecodeCost,
    KvLinks,
    PairContext,
    Role,
    does_decode,
    does_prefill,
)
from skymesh.routing.pairing.conductor import Conductor, ConductorOptions
from skymesh.routing.pairing.pricing import Candidate, PairPricing
from skymesh.routing.pairing.threshold import ThresholdOptions, ThresholdSplit
from skymesh.routing.region import RegionCore
from skymesh.routing.region_actions import AbandonAttempt, Reject, SendToReplica
from skymesh.routing.region_settings import RegionSettings
from skymesh.routing.registry import make_policy
from skymesh.routing.request_state import RequestState

H100 = PROFILES["h100-qwen2.5-7b"]
COST = DecodeCost.of_profile(H100)
CHUNK = 64
NOW = 100.0


def model() -> RegionModel:
    per_token, fixed = H100.ttft_seed()
    return RegionModel(chunk_tokens=CHUNK, prefill_s_per_token=per_token, first_token_fixed_s=max(fixed, 0.01))


def context(m: RegionModel | None = None, **kw: object) -> PairContext:
    return PairContext(model=m or model(), cost=COST, links=KvLinks(), **kw)  # type: ignore[arg-type]


def request(i: int, prompt: int, out: int, *, ttft_slo: float | None = None, tbt_slo: float | None = None,
            base: int = 0) -> RoutingRequest:
    chunks = tuple(base + k for k in range(-(-prompt // CHUNK)))
    return RoutingRequest(f"q{i}", chunks, prompt, 0.0, max_tokens=out, slo_ttft_s=ttft_slo, slo_tpot_s=tbt_slo)


# ---------------------------------------------------------------------------- random pools


def random_case(rng: random.Random, i: int) -> tuple[RegionModel, RoutingRequest, str, dict[str, ReplicaView],
                                                     dict[str, Role], set[str]]:
    """A pool of 2-5 replicas with random roles (one that may prefill, the policy's pick p,
    and one other that may decode), loads, cached prefixes and a random request."""
    n = rng.randint(2, 5)
    ids = [f"r{k}" for k in range(n)]
    roles: dict[str, Role] = {rid: rng.choice(("both", "prefill", "decode")) for rid in ids}
    p = rng.choice(ids)
    roles[p] = rng.choice(("both", "prefill"))
    other = rng.choice([rid for rid in ids if rid != p])
    if not does_decode(roles[other]):
        roles[other] = rng.choice(("both", "decode"))
    if rng.random() < 0.3:
        del roles[rng.choice(ids)]  # a missing role is "both"
        roles.setdefault(p, "both")
    prompt = rng.choice((rng.randint(16, 2000), rng.randint(2000, 30000)))
    out = rng.randint(1, 1500)
    req = request(i, prompt, out, base=1000 * i,
                  ttft_slo=math.exp(rng.uniform(math.log(0.05), math.log(5.0))) if rng.random() < 0.8 else None,
                  tbt_slo=math.exp(rng.uniform(math.log(0.004), math.log(0.3))) if rng.random() < 0.8 else None)
    m = model()
    views: dict[str, ReplicaView] = {}
    for rid in ids:
        v = ReplicaView(rid)
        v.healthy = rid == p or rng.random() < 0.85
        v.available = rid == p or rng.random() < 0.7
        v.num_running = rng.randint(0, 200)
        v.pending_prefill_tokens = rng.choice((0, rng.randint(0, 60000)))
        v.pending_decodes = rng.randint(0, 20)
        v.pending_decode_tokens = v.pending_decodes * rng.randint(0, 3000)
        v.kv_usage = rng.uniform(0.0, 0.9) if rng.random() < 0.7 else rng.uniform(0.9, 1.0)
        if rng.random() < 0.6:
            v.prefill_rate = rng.uniform(0.0, 40000.0)
            v.prefill_rate_since = NOW - rng.uniform(0.05, 60.0)
            v.prefill_rate_at = NOW - rng.uniform(0.0, 5.0)
        views[rid] = v
        cached = rng.randint(0, len(req.chunk_hashes))
        if cached:
            m.cache.insert(req.chunk_hashes[:cached], rid)
    excluded = {rid for rid in ids if rid != p and rng.random() < 0.15}
    return m, req, p, views, roles, excluded


def decoders_of(pricing: PairPricing, req: RoutingRequest, views: dict[str, ReplicaView], roles: dict[str, Role],
                excluded: set[str]) -> list[str]:
    """Healthy, allowed, decode-capable replicas with room for the request's KV (by the
    pricing's KV test, written out again here)."""
    out = []
    for rid, v in views.items():
        role = roles.get(rid, "both")
        used = v.kv_usage * COST.kv_capacity_tokens + v.pending_decode_tokens
        need = req.prompt_tokens + req.max_tokens
        # larger than an empty replica's KV: no wait makes room, it is not held back
        fits = need > COST.kv_capacity_tokens or used + need <= COST.kv_capacity_tokens
        assert fits == pricing.kv_fits(req, v)
        if rid not in excluded and v.healthy and role != "prefill" and fits:
            out.append(rid)
    return out


def decode_load_key(v: ReplicaView) -> tuple[int, float, str]:
    return (v.num_running + v.pending_decodes, v.kv_usage, v.replica_id)


# ---------------------------------------------------------------------------- 1. conductor


def algorithm_1_winners(req: RoutingRequest, ctx: PairContext, cands: list[Candidate]
                        ) -> tuple[dict[tuple[str, str | None], Candidate], str]:
    """Algorithm 1's pick among priced placements, by hand: the lowest TTFT among those
    meeting both targets (whole first), else the least violation (split first); every
    placement tied for it, and whether the winners meet the targets."""
    ttft_slo = req.slo_ttft_s if req.slo_ttft_s is not None else ctx.ttft_slo_s
    tbt_slo = req.slo_tpot_s if req.slo_tpot_s is not None else ctx.tbt_slo_s
    fit = [c for c in cands if c.ttft_s <= ttft_slo and c.tbt_s <= tbt_slo]
    if fit:
        keys = [(c.ttft_s, c.decode is not None) for c in fit]
        pool, what = fit, "meets"
    else:
        keys = [(max(c.ttft_s / ttft_slo, c.tbt_s / tbt_slo), c.decode is None) for c in cands]
        pool, what = cands, "misses"
    best = min(keys)
    return {(c.prefill, c.decode): c for c, k in zip(pool, keys, strict=True) if k == best}, what


def test_conductor_matches_brute_force_on_random_pools() -> None:
    rng = random.Random(38)
    seen = {"none": 0, "meets whole": 0, "meets split": 0, "misses whole": 0, "misses split": 0}
    for i in range(600):
        m, req, p, views, roles, excluded = random_case(rng, i)
        ctx = context(m)
        rule = Conductor(ConductorOptions(), ctx)
        pricing = PairPricing(ctx)
        decision = Decision(p, "policy", matched_tokens=0)
        choice = rule.choose(req, decision, views, roles, excluded, NOW)

        decoders = decoders_of(pricing, req, views, roles, excluded)
        matched = pricing.matched(req, list(dict.fromkeys([p, *decoders])))
        cands = []
        if does_decode(roles.get(p, "both")) and p in decoders:
            cands.append(pricing.aggregated(req, views[p], matched[p], NOW))
        cands += [pricing.split(req, views[p], views[d], matched[p], matched[d], NOW) for d in decoders if d != p]
        if not cands:
            assert choice is None, (i, choice)
            seen["none"] += 1
            continue
        assert choice is not None, i
        winners, what = algorithm_1_winners(req, ctx, cands)
        got = (choice.prefill_replica_id, choice.decode_replica_id)
        assert got in winners, (i, got, sorted(winners, key=str))
        w = winners[got]
        assert choice.predicted_ttft_s == pytest.approx(w.ttft_s, rel=1e-12)
        assert choice.predicted_tbt_s == pytest.approx(w.tbt_s, rel=1e-12)
        assert choice.matched_tokens == matched[p]
        assert choice.split == (w.decode is not None)
        if choice.split:
            assert choice.transfer_s > 0.0
            assert choice.decode_replica_id != p and choice.decode_replica_id not in excluded
        seen[f"{what} {'split' if choice.split else 'whole'}"] += 1
    # the random pools reach every outcome
    assert all(n > 0 for n in seen.values()), seen


def test_conductor_with_a_prefill_pool_matches_brute_force_on_random_pools() -> None:
    """``prefill_pool``: Algorithm 1 over every available prefill-capable replica the
    request may run on, each split priced from it to each decode replica; the policy's
    pick keeps the whole placement and ties (it is priced first)."""
    rng = random.Random(381)
    moved = 0
    for i in range(600):
        m, req, p, views, roles, excluded = random_case(rng, i)
        ctx = context(m)
        rule = Conductor(ConductorOptions(prefill_pool=True), ctx)
        pricing = PairPricing(ctx)
        choice = rule.choose(req, Decision(p, "policy", matched_tokens=0), views, roles, excluded, NOW)
        decoders = decoders_of(pricing, req, views, roles, excluded)
        prefills = [p] + [q for q, v in views.items() if q != p and q not in excluded and v.available and v.healthy
                          and roles.get(q, "both") != "decode"]
        matched = pricing.matched(req, list(dict.fromkeys([*prefills, *decoders])))
        cands = []
        if does_decode(roles.get(p, "both")) and p in decoders:
            cands.append(pricing.aggregated(req, views[p], matched[p], NOW))
        cands += [pricing.split(req, views[q], views[d], matched[q], matched[d], NOW)
                  for q in prefills for d in decoders if d != q]
        if not cands:
            assert choice is None, (i, choice)
            continue
        assert choice is not None, i
        winners, _ = algorithm_1_winners(req, ctx, cands)
        got = (choice.prefill_replica_id, choice.decode_replica_id)
        assert got in winners, (i, got, sorted(winners, key=str))
        assert choice.predicted_ttft_s == pytest.approx(winners[got].ttft_s, rel=1e-12)
        assert choice.matched_tokens == matched[choice.prefill_replica_id]
        if choice.prefill_replica_id != p:
            moved += 1
            assert views[choice.prefill_replica_id].available and choice.prefill_replica_id not in excluded
            assert roles.get(choice.prefill_replica_id, "both") != "decode"
    assert moved > 0  # the pool moves some prefills off the policy's pick


def test_conductor_prefill_pool_takes_the_idle_replica_over_the_policys_queued_pick() -> None:
    m = model()
    ctx = context(m, ttft_slo_s=2.0, tbt_slo_s=0.1)
    req = request(0, 8000, 200)
    p = ReplicaView("p", pending_prefill_tokens=120_000)  # a long prefill queue
    q = ReplicaView("q")  # idle, holds as much of the prompt (nothing)
    d = ReplicaView("d", num_running=2)
    views = {"p": p, "q": q, "d": d}
    roles: dict[str, Role] = {"p": "prefill", "q": "prefill", "d": "decode"}
    kept = Conductor(ConductorOptions(), ctx).choose(req, Decision("p"), views, roles, set(), NOW)
    assert kept is not None and kept.prefill_replica_id == "p"
    pooled = Conductor(ConductorOptions(prefill_pool=True), ctx).choose(req, Decision("p"), views, roles, set(), NOW)
    assert pooled is not None and (pooled.prefill_replica_id, pooled.decode_replica_id) == ("q", "d")
    assert pooled.predicted_ttft_s is not None and kept.predicted_ttft_s is not None
    assert pooled.predicted_ttft_s < kept.predicted_ttft_s
    # q busy (no unit free for a push), excluded, or decode-only: the pick stays p
    q.available = False
    assert Conductor(ConductorOptions(prefill_pool=True), ctx).choose(
        req, Decision("p"), views, roles, set(), NOW).prefill_replica_id == "p"


def test_conductor_splits_where_decoding_beside_prefill_breaks_tbt() -> None:
    m = model()
    ctx = context(m, tbt_slo_s=0.05, ttft_slo_s=5.0)
    rule = Conductor(ConductorOptions(), ctx)
    req = request(0, 4000, 300)
    # p has a heavy prefill backlog: a decode there shares its steps with prefill chunks
    p = ReplicaView("p", num_running=4, pending_prefill_tokens=200_000)
    d = ReplicaView("d", num_running=4)
    roles: dict[str, Role] = {"p": "both", "d": "decode"}
    choice = rule.choose(req, Decision("p"), {"p": p, "d": d}, roles, set(), NOW)
    assert choice is not None and (choice.prefill_replica_id, choice.decode_replica_id) == ("p", "d")
    # with no backlog anywhere, whole on p wins (lower TTFT, both targets met)
    p.pending_prefill_tokens = 0
    choice = rule.choose(req, Decision("p"), {"p": p, "d": d}, roles, set(), NOW)
    assert choice is not None and not choice.split and choice.prefill_replica_id == "p"
    # a prefill-only pick with no decode replica left: no placement, the request waits
    roles["p"] = "prefill"
    assert rule.choose(req, Decision("p"), {"p": p, "d": d}, roles, {"d"}, NOW) is None


def test_conductor_missing_both_targets_takes_the_least_violation_a_split_on_a_tie() -> None:
    rule = Conductor(ConductorOptions(), context(ttft_slo_s=100.0))
    req = request(0, 2000, 300, tbt_slo=1e-5)  # no step is that short: nothing meets it
    views = {"p": ReplicaView("p", num_running=3), "d": ReplicaView("d", num_running=3)}
    roles: dict[str, Role] = {"p": "both", "d": "decode"}
    whole, split = rule.candidates(req, Decision("p"), views, roles, set(), NOW)
    assert whole.decode is None and split.decode == "d"
    # the same decode step either way: TBT decides the violation, and they tie
    assert whole.violation(100.0, 1e-5) == split.violation(100.0, 1e-5) > 1.0
    choice = rule.choose(req, Decision("p"), views, roles, set(), NOW)
    assert choice is not None and (choice.prefill_replica_id, choice.decode_replica_id) == ("p", "d")
    assert choice.reason == "misses least"
    views["d"].num_running = 4  # one more sequence there: its steps are longer, whole misses less
    choice = rule.choose(req, Decision("p"), views, roles, set(), NOW)
    assert choice is not None and not choice.split and choice.prefill_replica_id == "p"


def test_conductor_whole_on_decode_prices_the_decode_replica_whole() -> None:
    m = model()
    rule = Conductor(ConductorOptions(whole_on_decode=True), context(m, ttft_slo_s=5.0, tbt_slo_s=0.2))
    req = request(0, 6400, 100)
    m.cache.insert(req.chunk_hashes, "d")  # d holds the whole prompt: its prefill is short
    views = {"p": ReplicaView("p", pending_prefill_tokens=20_000), "d": ReplicaView("d")}
    roles: dict[str, Role] = {"p": "prefill", "d": "decode"}
    choice = rule.choose(req, Decision("p"), views, roles, set(), NOW)
    assert choice is not None and (choice.prefill_replica_id, choice.decode_replica_id) == ("d", None)
    assert choice.matched_tokens == 6400
    views["d"].available = False  # only one that may take a request now is priced whole
    choice = rule.choose(req, Decision("p"), views, roles, set(), NOW)
    assert choice is not None and (choice.prefill_replica_id, choice.decode_replica_id) == ("p", "d")
    # off (the default): never whole on the decode replica
    rule = Conductor(ConductorOptions(), context(m, ttft_slo_s=5.0, tbt_slo_s=0.2))
    views["d"].available = True
    choice = rule.choose(req, Decision("p"), views, roles, set(), NOW)
    assert choice is not None and (choice.prefill_replica_id, choice.decode_replica_id) == ("p", "d")


# ---------------------------------------------------------------------------- 2. always


def test_always_picks_the_least_loaded_other_decode_replica() -> None:
    rng = random.Random(7)
    seen = {"split": 0, "whole": 0, "none": 0}
    for i in range(400):
        m, req, p, views, roles, excluded = random_case(rng, i)
        ctx = context(m)
        rule = AlwaysSplit(AlwaysOptions(), ctx)
        decision = Decision(p, "policy", matched_tokens=rng.randint(0, req.prompt_tokens))
        choice = rule.choose(req, decision, views, roles, excluded, NOW)
        others = [d for d in decoders_of(PairPricing(ctx), req, views, roles, excluded) if d != p]
        if others:
            want = min(others, key=lambda d: decode_load_key(views[d]))
            assert choice is not None and choice.prefill_replica_id == p and choice.decode_replica_id == want, i
            assert choice.matched_tokens == decision.matched_tokens
            seen["split"] += 1
        elif does_decode(roles.get(p, "both")):
            assert choice is not None and choice.prefill_replica_id == p and choice.decode_replica_id is None, i
            seen["whole"] += 1
        else:
            assert choice is None, i
            seen["none"] += 1
    assert all(n > 0 for n in seen.values()), seen


def test_always_skips_full_unhealthy_and_excluded_decode_replicas() -> None:
    ctx = context()
    rule = AlwaysSplit(AlwaysOptions(), ctx)
    req = request(0, 10_000, 1000)
    views = {
        "p": ReplicaView("p"),
        "full": ReplicaView("full", kv_usage=0.995),  # idle, but no room for 11K tokens
        "sick": ReplicaView("sick", healthy=False),
        "gone": ReplicaView("gone"),
        "busy": ReplicaView("busy", num_running=30),
        "booked": ReplicaView("booked", num_running=10, pending_decodes=25),
    }
    roles: dict[str, Role] = {"p": "prefill", "full": "decode", "sick": "decode", "gone": "both", "busy": "decode",
                              "booked": "decode"}
    choice = rule.choose(req, Decision("p"), views, roles, {"gone"}, NOW)
    assert choice is not None and choice.decode_replica_id == "busy"  # 30 < 10 + 25 booked
    views["busy"].num_running = 40
    choice = rule.choose(req, Decision("p"), views, roles, {"gone"}, NOW)
    assert choice is not None and choice.decode_replica_id == "booked"
    # none left: whole on p where p may decode, else it waits
    roles["booked"] = "prefill"
    roles["busy"] = "prefill"
    assert rule.choose(req, Decision("p"), views, roles, {"gone"}, NOW) is None
    roles["p"] = "both"
    choice = rule.choose(req, Decision("p"), views, roles, {"gone"}, NOW)
    assert choice is not None and choice.prefill_replica_id == "p" and not choice.split


# ---------------------------------------------------------------------------- 3. threshold


def test_threshold_against_its_rule_on_random_pools() -> None:
    rng = random.Random(11)
    seen = {"whole on d": 0, "whole on p": 0, "split": 0, "none": 0}
    for i in range(400):
        m, req, p, views, roles, excluded = random_case(rng, i)
        ctx = context(m)
        threshold = rng.choice((0, 64, 256, 1024, 8192))
        rule = ThresholdSplit(ThresholdOptions(threshold_tokens=threshold), ctx)
        decision = Decision(p, "policy", matched_tokens=rng.randint(0, req.prompt_tokens))
        choice = rule.choose(req, decision, views, roles, excluded, NOW)
        decoders = decoders_of(PairPricing(ctx), req, views, roles, excluded)
        if not decoders:
            assert choice is None, i
            seen["none"] += 1
            continue
        d = min(decoders, key=lambda r: decode_load_key(views[r]))
        assert choice is not None, i
        cached = m.cache.match_per_target(req.chunk_hashes, [d])[d]
        uncached = req.prompt_tokens - min(req.prompt_tokens, cached * CHUNK)
        if d == p:
            assert (choice.prefill_replica_id, choice.decode_replica_id) == (p, None), i
            seen["whole on p"] += 1
        elif uncached < threshold and views[d].available:
            assert (choice.prefill_replica_id, choice.decode_replica_id) == (d, None), i
            assert choice.matched_tokens == req.prompt_tokens - uncached
            seen["whole on d"] += 1
        else:
            assert (choice.prefill_replica_id, choice.decode_replica_id) == (p, d), i
            assert choice.matched_tokens == decision.matched_tokens
            seen["split"] += 1
    assert all(n > 0 for n in seen.values()), seen


def test_threshold_whole_below_the_threshold_split_at_and_above_it() -> None:
    m = model()
    rule = ThresholdSplit(ThresholdOptions(threshold_tokens=256), context(m))
    req = request(0, 64 * 20, 100)
    views = {"p": ReplicaView("p"), "d": ReplicaView("d")}
    roles: dict[str, Role] = {"p": "prefill", "d": "decode"}
    m.cache.insert(req.chunk_hashes[:17], "d")  # 3 chunks (192 tokens) uncached: below
    choice = rule.choose(req, Decision("p"), views, roles, set(), NOW)
    assert choice is not None and (choice.prefill_replica_id, choice.decode_replica_id) == ("d", None)
    assert choice.matched_tokens == 17 * 64
    views["d"].available = False  # it may not take a request now: split
    choice = rule.choose(req, Decision("p"), views, roles, set(), NOW)
    assert choice is not None and (choice.prefill_replica_id, choice.decode_replica_id) == ("p", "d")
    views["d"].available = True
    rule = ThresholdSplit(ThresholdOptions(threshold_tokens=192), context(m))  # exactly at: split
    choice = rule.choose(req, Decision("p"), views, roles, set(), NOW)
    assert choice is not None and (choice.prefill_replica_id, choice.decode_replica_id) == ("p", "d")
    with pytest.raises(ValueError):
        ThresholdOptions(threshold_tokens=-1)


# ---------------------------------------------------------------------------- 4. registry


def test_registry_builds_rules_and_refuses_unknown_names_and_options() -> None:
    ctx = context()
    assert make_pair_rule("never", {}, ctx) is None
    assert isinstance(make_pair_rule("always", {}, ctx), AlwaysSplit)
    t = make_pair_rule("threshold", {"threshold_tokens": 100}, ctx)
    assert isinstance(t, ThresholdSplit) and t.options.threshold_tokens == 100
    c = make_pair_rule("conductor", {"whole_on_decode": True}, ctx)
    assert isinstance(c, Conductor) and c.options.whole_on_decode is True
    assert make_pair_rule("conductor", {}, ctx).options.whole_on_decode is False  # type: ignore[union-attr]
    with pytest.raises(UnknownPairRuleError, match="bogus"):
        make_pair_rule("bogus", {}, ctx)
    assert issubclass(UnknownPairRuleError, ValueError)
    for name in ("never", "always", "threshold", "conductor"):
        with pytest.raises(ValueError, match="unknown option"):
            make_pair_rule(name, {"no_such_knob": 1}, ctx)
    with pytest.raises(ValueError, match="unknown option"):
        make_pair_rule("always", {"threshold_tokens": 10}, ctx)  # another rule's option


# ---------------------------------------------------------------------------- 5. tbt_s


def plain_step(req: RoutingRequest, v: ReplicaView) -> float:
    """The roofline step of ``v``'s batch plus this request, no prefill in it."""
    batch = v.num_running + v.pending_decodes + 1
    context_tokens = int(v.kv_usage * COST.kv_capacity_tokens + v.pending_decode_tokens + req.prompt_tokens)
    return (max(COST.weight_read_s, COST.compute_s_per_token * batch)
            + COST.attn_s_per_context_token * context_tokens + COST.decode_s_per_seq * batch)


@pytest.mark.parametrize("running", [0, 8, 300])
def test_tbt_is_the_plain_step_without_prefill_and_grows_with_it(running: int) -> None:
    pricing = PairPricing(context())
    req = request(0, 3000, 400)
    v = ReplicaView("r", num_running=running, pending_decodes=2, pending_decode_tokens=5000, kv_usage=0.2)
    plain = plain_step(req, v)
    assert pricing.tbt_s(req, v, NOW) == pytest.approx(plain, rel=1e-12)
    assert pricing.decode_step_s(req, v, 0) == pytest.approx(plain, rel=1e-12)
    with_chunk = pricing.decode_step_s(req, v, 3000)
    assert with_chunk > plain

    # pending prefill: non-decreasing, strictly while below the cap, capped at a chunk step
    last = plain
    for pending in (1, 100, 1000, 3000, 10_000, 50_000, 10**6):
        v.pending_prefill_tokens = pending
        tbt = pricing.tbt_s(req, v, NOW)
        assert last < tbt or tbt == pytest.approx(with_chunk, rel=1e-12), (pending, last, tbt)
        assert tbt <= with_chunk * (1 + 1e-12)
        last = tbt
    assert last == pytest.approx(with_chunk, rel=1e-12)

    # the recent prefill rate, the same way
    v.pending_prefill_tokens = 0
    last = plain
    for rate in (1.0, 100.0, 1000.0, 10_000.0, 100_000.0, 1e7):
        v.prefill_rate, v.prefill_rate_at, v.prefill_rate_since = rate, NOW, NOW - 1000.0
        assert v.prefill_rate_now(NOW) == pytest.approx(rate, rel=1e-9)
        tbt = pricing.tbt_s(req, v, NOW)
        assert last < tbt or tbt == pytest.approx(with_chunk, rel=1e-12), (rate, last, tbt)
        last = tbt
    assert last == pytest.approx(with_chunk, rel=1e-12)


@pytest.mark.parametrize(("pending", "rate", "out"), [
    (0, 0.0, 300), (2000, 0.0, 300), (0, 500.0, 300), (3000, 2000.0, 800), (0, 50.0, 2000), (100, 10.0, 5),
    (0, 2e6, 300),  # prefill arrives faster than the replica runs it: every step has a chunk
])
def test_tbt_follows_its_documented_chunk_count(pending: int, rate: float, out: int) -> None:
    """x steps of a decode's M carry a chunk, x = P + r (x s_chunk + (M - x) s_plain),
    solved here by iteration; its 90% count (x + z sqrt(x)) over M against the top tenth."""
    pricing = PairPricing(context())
    req = request(0, 3000, out)
    v = ReplicaView("r", num_running=16, kv_usage=0.05, pending_prefill_tokens=pending)
    if rate:
        v.prefill_rate, v.prefill_rate_at, v.prefill_rate_since = rate, NOW, NOW - 1000.0
    plain, chunk = pricing.decode_step_s(req, v, 0), pricing.decode_step_s(req, v, 3000)
    per_s = v.prefill_rate_now(NOW) / 3000
    if per_s * (chunk - plain) >= 1.0:
        want = chunk
    else:
        x = 0.0
        for _ in range(10_000):
            x = pending / 3000 + per_s * (x * chunk + (out - x) * plain)
        share = (x + 1.2816 * math.sqrt(x)) / out
        want = chunk if share >= 0.1 else (share * chunk + (0.1 - share) * plain) / 0.1
    assert pricing.tbt_s(req, v, NOW) == pytest.approx(want, rel=1e-9)


def test_prefill_rate_decays_and_feeds_tbt() -> None:
    pricing = PairPricing(context())
    req = request(0, 2000, 500)
    v = ReplicaView("r", num_running=4)
    before = pricing.tbt_s(req, v, NOW)
    for k in range(20):
        v.add_prefill(4000, NOW - 2.0 + 0.1 * k)
    assert v.prefill_rate_now(NOW) > 0.0
    assert pricing.tbt_s(req, v, NOW) > before
    # an hour later the rate has decayed away, and with it the chunks a decode would meet
    assert v.prefill_rate_now(NOW + 3600.0) < 1e-6 * v.prefill_rate_now(NOW)
    assert pricing.tbt_s(req, v, NOW + 3600.0) == pytest.approx(before, rel=1e-6)


# ---------------------------------------------------------------------------- 6. lifecycle

OK = ProbeSample()


def region_core(n: int, roles: dict[str, Role], *, policy: str = "least_load", **settings: object) -> RegionCore:
    m = model()
    core = RegionCore("here", make_policy(policy, PolicyContext(model=m)), OffloadRouter("here", {}, enabled=False),
                      RegionSettings(**settings), m)  # type: ignore[arg-type]
    core.set_replicas([f"r{i}" for i in range(n)], 0.0)
    core.set_roles(roles)
    core.local.pair_rule = AlwaysSplit(AlwaysOptions(), context(m))
    return core


def probe_all(core: RegionCore, now: float, samples: dict[str, ProbeSample] | None = None) -> None:
    for rid in list(core.view.replicas):
        core.probe(rid, (samples or {}).get(rid, OK), now)


def sends(actions: list[object]) -> list[SendToReplica]:
    return [a for a in actions if isinstance(a, SendToReplica)]


def test_split_request_walks_both_legs_through_the_region_core() -> None:
    core = region_core(2, {"r0": "prefill", "r1": "decode"})
    probe_all(core, 0.0)
    req = request(0, 1000, 200)
    assert core.submit(req, 0.0) == []
    (send,) = sends(core.tick(0.0))
    assert send.replica_id == "r0" and send.decision.replica_id == "r0"
    assert send.decision.decode_replica_id == "r1"
    r0, r1 = core.local.replicas["r0"], core.local.replicas["r1"]
    assert r0.in_flight == 1 and r0.pending_prefill_tokens == 1000
    assert (r1.in_flight, r1.pending_prefill_tokens) == (0, 0)
    assert (r1.pending_decodes, r1.pending_decode_tokens) == (1, 1200)
    assert core.view.state_of("q0") is RequestState.PLACED

    assert core.prefill_done("q0", 0.5) == "r1"
    assert (r0.in_flight, r0.pending_prefill_tokens) == (0, 0)
    assert (r1.pending_decodes, r1.pending_decode_tokens) == (1, 1200)
    assert core.view.state_of("q0") is RequestState.PLACED
    assert core.prefill_done("q0", 0.5) is None  # no prefill leg in flight any more

    ttft = core.first_token("q0", 0.6)
    assert ttft == pytest.approx(0.6)  # from the prefill leg's dispatch
    assert (r1.pending_decodes, r1.pending_decode_tokens) == (0, 0)
    assert core.view.state_of("q0") is RequestState.STREAMING
    core.complete("q0", 1.0)
    assert core.view.state_of("q0") is None and core.local.in_flight_count == 0
    for v in core.local.replicas.values():
        assert (v.in_flight, v.pending_prefill_tokens, v.pending_decodes, v.pending_decode_tokens) == (0, 0, 0, 0)


def test_prefill_done_for_a_whole_or_unknown_request_changes_nothing() -> None:
    core = region_core(2, {"r0": "prefill", "r1": "both"})
    core.local.pair_rule = None  # no pair rule: whole
    probe_all(core, 0.0)
    core.submit(request(0, 500, 10), 0.0)
    (send,) = sends(core.tick(0.0))
    assert send.decision.decode_replica_id is None
    assert core.prefill_done("q0", 0.1) is None and core.prefill_done("nope", 0.1) is None
    assert core.local.replicas[send.replica_id].in_flight == 1


@pytest.mark.parametrize("policy", ["least_load", "round_robin", "dualmap", "prefix_tree", "consistent_hash",
                                    "min_ttft"])
def test_the_policy_never_sees_decode_only_replicas(policy: str) -> None:
    core = region_core(3, {"r0": "prefill", "r1": "decode", "r2": "decode"}, policy=policy)
    busy = ProbeSample(num_running=50, kv_usage=0.1)
    now = 0.0
    placed = []
    for i in range(12):
        probe_all(core, now, {"r0": busy})  # the decode replicas look idle
        core.submit(request(i, 700, 50, base=1000 * i), now)
        for s in sends(core.tick(now)):
            placed.append(s.request_id)
            assert s.replica_id == "r0", (policy, s)
            assert s.decision.decode_replica_id in ("r1", "r2")
            core.prefill_done(s.request_id, now + 0.05)
            core.first_token(s.request_id, now + 0.06)
            core.complete(s.request_id, now + 0.5)
        now += 1.0
    assert len(placed) == 12
    assert core.local.policy.replica_ids == ["r0"]  # type: ignore[attr-defined]
    # the budget of r0 is the only one spent: with r0 full, the decode replicas take nothing
    for i in range(12, 16):
        core.submit(request(i, 700, 50, base=1000 * i), now)
    got = sends(core.tick(now))
    assert [s.replica_id for s in got] == ["r0"] * len(got) and len(got) == core.settings.dispatch_budget
    assert core.local.queue_length == 4 - len(got)


def test_a_decode_leg_failing_before_its_first_token_goes_to_another_decode_replica() -> None:
    core = region_core(3, {"r0": "prefill", "r1": "decode", "r2": "decode"})
    probe_all(core, 0.0)
    core.submit(request(0, 800, 100), 0.0)
    (send,) = sends(core.tick(0.0))
    assert (send.replica_id, send.decision.decode_replica_id) == ("r0", "r1")
    # the KV move the rule priced travels with the placement, for the decode leg's deadline
    assert send.decision.transfer_s > 0 and core.view.transfer_estimate_s("q0") == send.decision.transfer_s
    assert core.prefill_done("q0", 0.2) == "r1"
    r0, r1, r2 = (core.local.replicas[r] for r in ("r0", "r1", "r2"))
    assert r1.pending_decodes == 1
    # the KV is held on r0: the decode leg alone is placed again, on r2, at once
    (again,) = sends(core.fail("q0", 0.3, reason="connection refused"))
    assert (again.request_id, again.replica_id) == ("q0", "r2")
    assert again.decision.decode_leg and again.decision.replica_id == "r2"
    assert again.decision.transfer_s > 0 and core.view.transfer_estimate_s("q0") == again.decision.transfer_s
    assert core.view.state_of("q0") is RequestState.PLACED
    assert (r1.pending_decodes, r1.pending_decode_tokens) == (0, 0)
    assert (r2.pending_decodes, r2.pending_decode_tokens) == (1, 900)
    assert (r0.in_flight, r0.pending_prefill_tokens) == (0, 0)
    assert core.local.in_flight_count == 1 and core.local.counters.retried == 1
    assert not r1.available  # held until its next probe, as after any retry
    # its first token now comes from r2; nothing stays booked after it
    core.first_token("q0", 0.4)
    core.complete("q0", 0.5)
    assert all((v.in_flight, v.pending_decodes, v.pending_decode_tokens) == (0, 0, 0)
               for v in core.local.replicas.values())


def test_a_decode_leg_with_no_other_decode_replica_is_prefilled_again() -> None:
    core = region_core(3, {"r0": "prefill", "r1": "decode", "r2": "decode"}, max_retries=3)
    probe_all(core, 0.0)
    core.submit(request(0, 800, 100), 0.0)
    sends(core.tick(0.0))
    core.prefill_done("q0", 0.2)
    (again,) = sends(core.fail("q0", 0.3, reason="connection refused"))
    # the second decode replica fails it too: none is left, the request is queued again
    assert sends(core.fail("q0", 0.35, reason="connection refused")) == []
    assert again.replica_id == "r2" and core.view.state_of("q0") is RequestState.QUEUED
    r0, r1, r2 = (core.local.replicas[r] for r in ("r0", "r1", "r2"))
    assert all((v.in_flight, v.pending_decodes, v.pending_decode_tokens) == (0, 0, 0) for v in (r0, r1, r2))
    probe_all(core, 0.4)
    # never back to a replica that failed it: with both decode replicas excluded it waits
    # (for its queue-wait deadline, or a decode replica that joins)
    assert sends(core.tick(0.4)) == [] and core.view.state_of("q0") is RequestState.QUEUED
    core.set_replicas(["r0", "r1", "r2", "r3"], 0.5)
    core.set_roles({"r0": "prefill", "r1": "decode", "r2": "decode", "r3": "decode"})
    core.probe("r3", OK, 0.5)
    (whole,) = sends(core.tick(0.5))
    assert (whole.replica_id, whole.decision.decode_replica_id) == ("r0", "r3")  # prefilled again


def test_roles_filter_the_policys_replicas_whichever_comes_first() -> None:
    core = region_core(3, {"r1": "decode"})
    assert core.local.policy.replica_ids == ["r0", "r2"]  # type: ignore[attr-defined]
    core.set_replicas(["r0", "r1", "r2", "r3"], 1.0)  # a new replica, roles kept
    assert core.local.policy.replica_ids == ["r0", "r2", "r3"]  # type: ignore[attr-defined]
    core.set_roles({"r0": "prefill", "r3": "decode"})  # prefill-only ones stay the policy's
    assert core.local.policy.replica_ids == ["r0", "r1", "r2"]  # type: ignore[attr-defined]


def test_a_region_advertises_the_replicas_a_new_request_may_start_on() -> None:
    """The heartbeat counts roles ``both`` and ``prefill`` (a decode-only replica cannot
    take a new request); the snapshot names every replica's role."""
    core = region_core(4, {"r0": "prefill", "r1": "decode", "r2": "decode"})
    probe_all(core, 0.0)
    beat = core.view.heartbeat(0.0)
    assert (beat.replicas_total, beat.replicas_available) == (2, 2)  # r0 and r3
    assert core.view.available_count() == 4  # every replica is available itself
    core.probe("r3", ProbeSample(num_waiting=1), 0.1)  # busy: not available
    assert core.view.heartbeat(0.1).replicas_available == 1
    roles = {rid: r["role"] for rid, r in core.view.snapshot()["replicas"].items()}
    assert roles == {"r0": "prefill", "r1": "decode", "r2": "decode", "r3": "both"}
    aggregated = region_core(3, {})
    probe_all(aggregated, 0.0)
    assert aggregated.view.heartbeat(0.0).replicas_total == 3  # all ``both``: every replica


def test_a_failed_decode_leg_counts_against_its_decode_replica() -> None:
    core = region_core(3, {"r0": "prefill", "r1": "decode", "r2": "decode"},
                       health=HealthSettings(unhealthy_threshold=1))
    probe_all(core, 0.0)
    core.submit(request(0, 800, 100), 0.0)
    sends(core.tick(0.0))
    core.prefill_done("q0", 0.2)
    core.fail("q0", 0.3, reason="connection refused")
    assert not core.local.replicas["r1"].healthy
    assert core.local.replicas["r0"].healthy and core.local.replicas["r2"].healthy


def test_ejecting_the_decode_replica_abandons_the_decode_leg_and_releases_it() -> None:
    core = region_core(3, {"r0": "prefill", "r1": "decode", "r2": "decode"},
                       health=HealthSettings(unhealthy_threshold=1))
    probe_all(core, 0.0)
    core.submit(request(0, 800, 100), 0.0)
    sends(core.tick(0.0))
    core.prefill_done("q0", 0.2)
    # ejecting the prefill replica abandons nothing: it no longer holds the request
    assert core.probe("r0", None, 0.25) == [] and not core.local.replicas["r0"].healthy
    assert core.probe("r1", None, 0.3) == [AbandonAttempt("q0", "r1")]
    assert core.view.state_of("q0") is RequestState.QUEUED
    assert core.local.replicas["r1"].pending_decodes == 0 and core.local.in_flight_count == 0
    for now in (0.4, 0.45):  # r0 back after two good probes; r1 stays out
        core.probe("r0", OK, now)
        core.probe("r2", OK, now)
    assert core.local.replicas["r0"].healthy and not core.local.replicas["r1"].healthy
    (again,) = sends(core.tick(0.45))
    assert (again.replica_id, again.decision.decode_replica_id) == ("r0", "r2")


@pytest.mark.parametrize("rule", ["always", "threshold", "conductor"])
def test_a_draining_replica_gets_no_new_decode_leg(rule: str) -> None:
    core = region_core(3, {"r0": "prefill", "r1": "decode", "r2": "decode"})
    core.local.pair_rule = make_pair_rule(rule, {}, context(core.model))
    probe_all(core, 0.0)
    core.set_draining(["r1"])  # leaving membership: "none of them gets a new dispatch"
    core.submit(request(0, 800, 100), 0.0)
    (send,) = sends(core.tick(0.0))
    assert send.decision.decode_replica_id == "r2"
    assert core.local.replicas["r1"].pending_decodes == 0


def test_a_decode_leg_failing_with_no_budget_left_releases_everything() -> None:
    core = region_core(2, {"r0": "prefill", "r1": "decode"}, max_retries=0)
    probe_all(core, 0.0)
    core.submit(request(0, 800, 100), 0.0)
    sends(core.tick(0.0))
    core.prefill_done("q0", 0.2)
    actions = core.fail("q0", 0.3, reason="connection refused")
    assert [type(a) for a in actions] == [Reject]
    assert core.view.state_of("q0") is None and core.local.in_flight_count == 0
    for v in core.local.replicas.values():
        assert (v.in_flight, v.pending_prefill_tokens, v.pending_decodes, v.pending_decode_tokens) == (0, 0, 0, 0)


@pytest.mark.parametrize("after_prefill", [False, True])
def test_a_client_leaving_either_leg_releases_both_bookings(after_prefill: bool) -> None:
    core = region_core(2, {"r0": "prefill", "r1": "decode"})
    probe_all(core, 0.0)
    core.submit(request(0, 800, 100), 0.0)
    sends(core.tick(0.0))
    if after_prefill:
        core.prefill_done("q0", 0.2)
    core.client_gone("q0", 0.3)
    assert core.local.in_flight_count == 0
    for v in core.local.replicas.values():
        assert (v.in_flight, v.pending_prefill_tokens, v.pending_decodes, v.pending_decode_tokens) == (0, 0, 0, 0)


def test_roles_helpers() -> None:
    assert [does_prefill(r) for r in ("both", "prefill", "decode")] == [True, True, False]
    assert [does_decode(r) for r in ("both", "prefill", "decode")] == [True, False, True]
    links = KvLinks(bytes_per_s=1e9, latency_s=0.001, pairs={("a", "b"): (2e9, 0.01)})
    assert links.transfer_s("a", "c", 1e9) == pytest.approx(1.001)
    assert links.transfer_s("a", "b", 1e9) == pytest.approx(0.51)
    assert links.transfer_s("b", "a", 1e9) == pytest.approx(1.001)  # ordered pairs


@pytest.mark.parametrize("rule", ["always", "threshold", "conductor"])
def test_a_decode_replica_lost_during_the_prefill_is_replaced_when_the_kv_is_ready(rule: str) -> None:
    core = region_core(3, {"r0": "prefill", "r1": "decode", "r2": "decode"},
                       health=HealthSettings(unhealthy_threshold=1))
    core.local.pair_rule = make_pair_rule(rule, {}, context(core.model))
    probe_all(core, 0.0)
    core.submit(request(0, 800, 100), 0.0)
    (send,) = sends(core.tick(0.0))
    first = send.decision.decode_replica_id
    other = "r2" if first == "r1" else "r1"
    core.probe(first, None, 0.1)  # ejected while the prefill runs (nothing of it started there)
    assert not core.local.replicas[first].healthy
    assert core.prefill_done("q0", 0.2) == other
    assert core.local.replicas[first].pending_decodes == 0 and core.local.replicas[other].pending_decodes == 1
    core.first_token("q0", 0.3)
    core.complete("q0", 0.4)
    assert all(v.pending_decodes == 0 and v.pending_decode_tokens == 0 for v in core.local.replicas.values())


def test_a_lost_decode_replica_is_kept_when_no_other_can_decode() -> None:
    core = region_core(2, {"r0": "prefill", "r1": "decode"}, health=HealthSettings(unhealthy_threshold=1))
    probe_all(core, 0.0)
    core.submit(request(0, 800, 100), 0.0)
    sends(core.tick(0.0))
    core.probe("r1", None, 0.1)
    assert core.prefill_done("q0", 0.2) == "r1"  # its attempt there fails; the request is placed again
    assert core.local.replicas["r1"].pending_decodes == 1


# ---------------------------------------------------------------------------- 7. refusals


def test_conductor_refuses_what_no_placement_serves_within_both_targets_where_the_region_rejects_early() -> None:
    views = {"p": ReplicaView("p", num_running=3), "d": ReplicaView("d", num_running=4)}
    roles: dict[str, Role] = {"p": "both", "d": "decode"}
    hopeless = request(0, 2000, 300, tbt_slo=1e-5)  # no step is that short
    keeps = Conductor(ConductorOptions(), context(ttft_slo_s=100.0))
    refuses = Conductor(ConductorOptions(), context(ttft_slo_s=100.0, refuse_unmet=True))
    placed = keeps.choose(hopeless, Decision("p"), views, roles, set(), NOW)
    refused = refuses.choose(hopeless, Decision("p"), views, roles, set(), NOW)
    assert placed is not None and not placed.refused
    # the refusal names the placement that missed least, with its predictions
    assert refused is not None and refused.refused
    assert (refused.prefill_replica_id, refused.decode_replica_id) == (placed.prefill_replica_id,
                                                                       placed.decode_replica_id)
    assert refused.predicted_tbt_s == placed.predicted_tbt_s and refused.predicted_tbt_s > 1e-5
    # a peer's forward is placed where it misses least: its origin judged it
    forwarded = dataclasses.replace(hopeless, forwarded=True)
    got = refuses.choose(forwarded, Decision("p"), views, roles, set(), NOW)
    assert got is not None and not got.refused
    # a request some placement serves in time is placed
    fine = refuses.choose(request(1, 2000, 300), Decision("p"), views, roles, set(), NOW)
    assert fine is not None and not fine.refused


def test_a_refused_request_leaves_the_region_with_a_429_and_nothing_booked() -> None:
    core = region_core(3, {"r0": "prefill", "r1": "decode"}, retry_after_s=1.0, ttft_slo_s=0.5)
    core.local.pair_rule = Conductor(ConductorOptions(), context(core.model, ttft_slo_s=0.5, refuse_unmet=True))
    probe_all(core, 0.0)
    # a prompt whose prefill alone takes longer than the 0.5 s target everywhere
    core.submit(request(0, 60_000, 100), 0.0)
    core.submit(request(1, 500, 100), 0.0)
    actions = core.tick(0.0)
    (reject,) = [a for a in actions if isinstance(a, Reject)]
    assert (reject.request_id, reject.status, reject.code) == ("q0", 429, "slo_unreachable")
    assert reject.retry_after_s is not None and reject.retry_after_s > 1.0  # past its target by more than 1 s
    assert "time between tokens" in reject.message
    assert [s.request_id for s in sends(actions)] == ["q1"]  # the next one is served
    assert core.view.state_of("q0") is None and core.local.counters.refused_by_pair_rule == 1
    # only q1's legs are booked: q0's refusal left nothing on any replica
    r0, r1 = core.local.replicas["r0"], core.local.replicas["r1"]
    assert (r0.in_flight, r0.pending_prefill_tokens) == (1, 500)
    assert (r1.pending_decodes, r1.pending_decode_tokens) == (1, 600)
    assert core.local.queue_length == 0 and core.local.in_flight_count == 1


def test_the_region_rejects_early_by_the_pair_rule_as_its_settings_say() -> None:
    for early in (True, False):
        assembly = RegionAssembly(
            "here", PolicySettings("least_load", CHUNK, 2.0, 1000),
            OffloadSettings(False, 4, 1.0, 3, "predicted_ttft", 0.0),
            RegionSettings(early_rejection=early), CostSeed(*H100.ttft_seed()), {}, False,
            pairing=PairingSettings("conductor", COST))
        rule = build_region_core(assembly).local.pair_rule
        assert isinstance(rule, Conductor) and rule.pricing.ctx.refuse_unmet is early


def test_a_region_without_a_replica_that_may_decode_answers_503_at_once() -> None:
    core = region_core(3, {"r0": "prefill", "r1": "decode", "r2": "decode"},
                       health=HealthSettings(unhealthy_threshold=1))
    probe_all(core, 0.0)
    assert core.submit(request(0, 800, 100), 0.0) == []
    core.probe("r1", None, 0.1)
    assert core.submit(request(1, 800, 100), 0.1) == []  # r2 may still decode
    core.probe("r2", None, 0.2)
    (reject,) = core.submit(request(2, 800, 100), 0.2)
    assert isinstance(reject, Reject) and (reject.status, reject.code) == (503, "no_capacity")
    assert "may decode" in reject.message
    # the decode side back, the prefill side gone
    for now in (0.3, 0.35):
        core.probe("r2", OK, now)
    core.probe("r0", None, 0.4)
    (reject,) = core.submit(request(3, 800, 100), 0.4)
    assert isinstance(reject, Reject) and reject.status == 503 and "may prefill" in reject.message
    # a replica of role both serves either side
    core.set_roles({"r0": "prefill", "r1": "decode", "r2": "both"})
    assert core.submit(request(4, 800, 100), 0.5) == []


def test_a_request_larger_than_any_replicas_kv_is_placed_not_held_for_good() -> None:
    """Its KV (prompt and output) exceeds an empty decode replica's: waiting for room
    would keep it queued for good (a balancer that over-counts a prompt's tokens met
    this live), so room does not hold it back."""
    core = region_core(3, {"r0": "prefill", "r1": "decode", "r2": "decode"})
    probe_all(core, 0.0)
    core.local.replicas["r1"].kv_usage = 0.5
    huge = request(0, COST.kv_capacity_tokens, 100)
    core.submit(huge, 0.0)
    (send,) = sends(core.tick(0.0))
    assert (send.replica_id, send.decision.decode_replica_id) == ("r0", "r2")  # the less loaded
    # one that fits an empty replica still waits for room while both are full
    for rid in ("r1", "r2"):
        core.local.replicas[rid].kv_usage = 1.0
    core.submit(request(1, 1000, 100), 0.0)
    assert sends(core.tick(0.0)) == [] and core.view.state_of("q1") is RequestState.QUEUED
