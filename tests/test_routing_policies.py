"""Each policy's defining rule on hand-made views; DualMap's choice and migration rules."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.base import PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.hashing import prompt_chunk_hashes
from skymesh.routing.policies.dualmap import DualMapPolicy
from skymesh.routing.registry import POLICIES, make_policy

IDS = [f"r{i}" for i in range(6)]
CTX = PolicyContext(chunk_tokens=64, ttft_slo_s=1.0, prefill_s_per_token=1e-3, prefill_fixed_s=0.01)


def req(prefix: int, i: int = 0, n: int = 512, arrival: float = 0.0, session: str | None = None) -> RoutingRequest:
    text = " ".join([f"p{prefix}w{k}" for k in range(n - 16)] + [f"u{i}w{k}" for k in range(16)])
    return RoutingRequest(f"{prefix}-{i}", prompt_chunk_hashes(text, 64), n, arrival, session_key=session)


def views(**over: dict) -> dict[str, ReplicaView]:
    out = {rid: ReplicaView(rid) for rid in IDS}
    for rid, fields in over.items():
        for k, v in fields.items():
            setattr(out[rid], k, v)
    return out


def policy(name: str):  # noqa: ANN201
    p = make_policy(name, CTX)
    p.set_replicas(IDS)
    return p


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(POLICIES)), busy=st.sets(st.sampled_from(IDS), max_size=5),
       prefix=st.integers(0, 50))
def test_every_policy_returns_only_available_healthy_replicas(name: str, busy: set[str], prefix: int) -> None:
    p = policy(name)
    vs = views(**{rid: {"available": False} for rid in busy})
    d = p.choose(req(prefix, arrival=-10.0), vs, 0.0)  # waited long: even dualmap must not hold
    assert d.replica_id is not None and d.replica_id not in busy


def test_round_robin_cycles() -> None:
    p = policy("round_robin")
    picks = [p.choose(req(0, i), views(), 0.0).replica_id for i in range(12)]
    assert picks == IDS + IDS


def test_least_load_picks_fewest_pending_tokens() -> None:
    p = policy("least_load")
    vs = views(**{rid: {"pending_prefill_tokens": 1000} for rid in IDS if rid != "r4"})
    assert p.choose(req(0), vs, 0.0).replica_id == "r4"


def test_consistent_hash_sticks_to_session_and_skips_unavailable() -> None:
    p = policy("consistent_hash")
    first = p.choose(req(1, session="alice"), views(), 0.0).replica_id
    assert all(p.choose(req(k, session="alice"), views(), 0.0).replica_id == first for k in range(5))
    other = p.choose(req(1, session="alice"), views(**{first: {"available": False}}), 0.0).replica_id
    assert other is not None and other != first


def test_prefix_tree_prefers_longest_cached_prefix_then_least_load() -> None:
    p = policy("prefix_tree")
    p.on_dispatch(req(3, 0), "r2", 0.0)
    assert p.choose(req(3, 1), views(r2={"pending_prefill_tokens": 5000}), 0.0).replica_id == "r2"
    assert p.choose(req(3, 1), views(r2={"available": False}, r5={"in_flight": 0}), 0.0).replica_id != "r2"
    vs = views(**{rid: {"pending_prefill_tokens": 100} for rid in IDS if rid != "r1"})
    assert p.choose(req(9), vs, 0.0).replica_id == "r1"


def test_cache_aware_threshold_and_imbalance() -> None:
    p = policy("cache_aware")
    p.on_dispatch(req(4, 0), "r3", 0.0)
    assert p.choose(req(4, 1), views(), 0.0).replica_id == "r3"  # ~97% cached > 0.5
    # imbalance: r3 has 40 in flight, others 0 → abs (40 > 32) and rel (40 > 1.5 x 0)
    vs = views(r3={"in_flight": 40})
    assert p.choose(req(4, 2), vs, 0.0).replica_id != "r3"
    short = req(4, 3, n=512)
    tiny_prefix = RoutingRequest("x", short.chunk_hashes[:1] + (123, 456, 789, 1011, 1213, 1415, 1617), 512, 0.0)
    assert p.choose(tiny_prefix, views(), 0.0).replica_id != "r3"  # 1/8 cached < 0.5


def test_min_ttft_trades_cache_hits_against_queue() -> None:
    p = policy("min_ttft")
    p.on_dispatch(req(5, 0), "r0", 0.0)
    assert p.choose(req(5, 1), views(), 0.0).replica_id == "r0"
    # r0's queue (2000 tokens ahead) costs more than recomputing 512 tokens elsewhere
    assert p.choose(req(5, 2), views(r0={"pending_prefill_tokens": 2000}), 0.0).replica_id != "r0"


def test_preble_hit_rule_then_load_cost() -> None:
    p = policy("preble")
    p.on_dispatch(req(6, 0), "r5", 0.0)
    assert p.choose(req(6, 1), views(r5={"pending_prefill_tokens": 9000}), 0.0).replica_id == "r5"
    vs = views(**{rid: {"pending_prefill_tokens": 700} for rid in IDS if rid != "r2"})
    assert p.choose(req(60), vs, 0.0).replica_id == "r2"


# ----------------------------------------------------------------------------- DualMap


def dualmap() -> DualMapPolicy:
    # holding is off by default; these tests exercise the hold/spill/migrate rules
    p = DualMapPolicy(dataclasses.replace(CTX, options={"max_hold_fraction": 0.5}))
    p.set_replicas(IDS)
    return p


def test_dualmap_equal_hits_pick_the_less_loaded_candidate() -> None:
    p = dualmap()
    r = req(7)
    c1, c2 = p.candidates(r)
    assert p.choose(r, views(**{c1: {"pending_prefill_tokens": 300}}), 0.0).replica_id == c2
    assert p.choose(r, views(**{c2: {"pending_prefill_tokens": 300}}), 0.0).replica_id == c1


def test_dualmap_keeps_cache_affinity_while_slo_holds_then_switches() -> None:
    p = dualmap()
    r0 = req(8, 0)
    c1, c2 = p.candidates(r0)
    p.on_dispatch(r0, c2, 0.0)  # c2 now holds the prefix
    r1 = req(8, 1)
    # affine c2 is more loaded but its estimate (0.01 + 1e-3 * (400 + 16)) = 0.43 s <= SLO 1 s
    d = p.choose(r1, views(**{c2: {"pending_prefill_tokens": 400}}), 0.0)
    assert (d.replica_id, d.reason) == (c2, "affinity")
    # once its estimate breaks the SLO (1e-3 * 1500 > 1 s), the lower estimate wins
    d = p.choose(r1, views(**{c2: {"pending_prefill_tokens": 1500}}), 0.0)
    assert d.replica_id == c1


def test_dualmap_holds_for_its_candidates_then_spills() -> None:
    p = dualmap()
    r = req(9, arrival=0.0)
    c1, c2 = p.candidates(r)
    busy = views(**{c1: {"available": False}, c2: {"available": False}})
    d = p.choose(r, busy, 0.0)
    assert d.replica_id is None and d.reason == "hold"
    d = p.choose(r, busy, 0.9)  # waited 0.9 s of a 1 s SLO: spill
    assert d.reason == "spill" and d.replica_id not in (c1, c2)


def test_dualmap_migrates_held_requests_only_with_benefit_and_slo() -> None:
    p = dualmap()
    r = req(10, arrival=0.0)
    c1, c2 = p.candidates(r)
    busy = views(**{c1: {"available": False}, c2: {"available": False}})
    assert p.choose(r, busy, 0.0).replica_id is None
    held_for = p.held[r.request_id]
    other = c2 if held_for == c1 else c1
    # no benefit: the other candidate is more loaded → stays
    vs = views(**{held_for: {"available": False, "pending_prefill_tokens": 100},
                  other: {"available": False, "pending_prefill_tokens": 300}})
    assert p.rebalance([r], vs, 0.0) == []
    # benefit and the other meets the SLO → migrates
    vs = views(**{held_for: {"available": False, "pending_prefill_tokens": 900},
                  other: {"available": False, "pending_prefill_tokens": 0}})
    moves = p.rebalance([r], vs, 0.0)
    assert len(moves) == 1 and moves[0].to_replica == other and moves[0].benefit_s > 0
    assert p.held[r.request_id] == other
    # benefit but the target would break the SLO → no migration
    p2 = dualmap()
    assert p2.choose(r, busy, 0.0).replica_id is None
    h2 = p2.held[r.request_id]
    o2 = c2 if h2 == c1 else c1
    vs = views(**{h2: {"available": False, "pending_prefill_tokens": 5000},
                  o2: {"available": False, "pending_prefill_tokens": 2000}})
    assert p2.rebalance([r], vs, 0.0) == []


def test_dualmap_default_spills_instead_of_holding() -> None:
    p = DualMapPolicy(CTX)
    p.set_replicas(IDS)
    r = req(12, arrival=0.0)
    c1, c2 = p.candidates(r)
    busy = views(**{c1: {"available": False}, c2: {"available": False}})
    assert p.choose(r, busy, 0.01).reason == "spill"


def test_dualmap_spreads_a_hot_prefix_beyond_one_pair() -> None:
    p = dualmap()
    used = set()
    for i in range(300):
        r = req(11, i)  # one very popular system prompt, distinct user turns
        d = p.choose(r, views(), float(i))
        assert d.replica_id is not None
        p.on_dispatch(r, d.replica_id, float(i))
        used.add(d.replica_id)
    assert len(used) > 2
