"""Each baseline policy's defining rule on hand-made views, and the registry.
(DualMap's rules: test_routing_dualmap.py.)"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.base import Policy, PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.hashing import prompt_chunk_hashes
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


def test_registry_names_match_the_protocol() -> None:
    for name in POLICIES:
        p = make_policy(name, CTX)
        assert isinstance(p, Policy) and p.name == name
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest", CTX)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_full_request_lifecycle_and_json_stats(name: str) -> None:
    p = policy(name)
    for i in range(20):
        r = req(i % 3, i)
        d = p.choose(r, views(), float(i))
        assert d.replica_id in IDS
        p.on_dispatch(r, d.replica_id, float(i))
        p.on_first_token(r, d.replica_id, 0.1, float(i) + 0.1)
        p.on_complete(r, d.replica_id, i % 5 != 0, float(i) + 0.5)
    assert p.rebalance([], views(), 30.0) == []
    json.dumps(p.stats())


@pytest.mark.parametrize("name", ["prefix_tree", "cache_aware", "min_ttft", "preble", "dualmap"])
def test_cache_tracking_policies_forget_removed_replicas(name: str) -> None:
    p = policy(name)
    p.on_dispatch(req(30, 0), "r4", 0.0)
    assert p.cache.match_per_target(req(30, 1).chunk_hashes, ["r4"])["r4"] > 0
    p.set_replicas([x for x in IDS if x != "r4"])
    assert p.cache.match_per_target(req(30, 1).chunk_hashes, ["r4"]) == {"r4": 0}


def test_round_robin_skips_busy_replicas_without_losing_its_place() -> None:
    p = policy("round_robin")
    assert p.choose(req(0), views(), 0.0).replica_id == "r0"
    assert p.choose(req(0), views(r1={"available": False}, r2={"healthy": False}), 0.0).replica_id == "r3"
    assert p.choose(req(0), views(), 0.0).replica_id == "r4"


def test_least_load_breaks_ties_by_in_flight() -> None:
    p = policy("least_load")
    vs = views(**{rid: {"in_flight": 3} for rid in IDS if rid != "r2"})
    assert p.choose(req(0), vs, 0.0).replica_id == "r2"


def test_cache_aware_needs_both_imbalance_thresholds() -> None:
    p = policy("cache_aware")
    p.on_dispatch(req(31, 0), "r1", 0.0)
    # abs gap 50 > 32 but 200 < 1.5 x 150: balanced enough → the cache hit wins
    vs = views(**{rid: {"in_flight": 150} for rid in IDS})
    vs["r1"].in_flight = 200
    assert p.choose(req(31, 1), vs, 0.0).replica_id == "r1"
    # rel 20 > 1.5 x 1 but abs gap 19 <= 32 → still the cache hit
    vs = views(**{rid: {"in_flight": 1} for rid in IDS})
    vs["r1"].in_flight = 20
    assert p.choose(req(31, 2), vs, 0.0).replica_id == "r1"
    # both → least loaded
    vs["r1"].in_flight = 40
    vs["r5"].in_flight = 0
    assert p.choose(req(31, 3), vs, 0.0).replica_id == "r5"


def test_cache_aware_sends_new_prefixes_to_the_smallest_tree() -> None:
    p = policy("cache_aware")
    for k, rid in enumerate(IDS):
        if rid != "r3":
            p.on_dispatch(req(40 + k, 0), rid, 0.0)
    assert p.choose(req(99), views(), 0.0).replica_id == "r3"


def test_min_ttft_estimate_is_queue_plus_uncached_prefill() -> None:
    p = policy("min_ttft")
    p.on_dispatch(req(32, 0), "r2", 0.0)
    vs = views(**{rid: {"pending_prefill_tokens": 1000} for rid in IDS})
    vs["r2"].pending_prefill_tokens = 1300  # 300 more queued, but 448 tokens cached
    d = p.choose(req(32, 1), vs, 0.0)
    assert d.replica_id == "r2" and d.matched_tokens == 448
    assert abs(d.estimated_ttft_s - (0.01 + 1e-3 * (1300 + 64))) < 1e-9


def test_preble_explores_by_windowed_load_plus_missed_prefill() -> None:
    p = policy("preble")  # 1 ms per prefill token; 30 ms per output token until observed
    a = req(33, 0, n=512)
    p.on_dispatch(a, "r0", 0.0)  # r0 computed 512 tokens: 0.512 s of load in the window
    p.on_complete(a, "r0", True, 1.0)
    # a 1024-token prompt sharing only its first 256 tokens with r0 (25%: below ½, explore)
    text = " ".join([f"p33w{k}" for k in range(256)] + [f"z{k}" for k in range(768)])
    half = RoutingRequest("half", prompt_chunk_hashes(text, 64), 1024, 2.0)
    vs = views()
    # r0: 0.512 + 0.768 s to prefill what it misses; any other: 0 + 1.024 s
    d = p.choose(half, vs, 2.0)
    assert d.replica_id == "r1" and d.reason == "explore"
    # once r0's work has left the 3-minute window, its cached 256 tokens make it cheapest
    assert p.choose(half, vs, 200.0).replica_id == "r0"
    # decode still owed counts: r0 busy with an active 1000-token answer (30 s at 30 ms)
    long = RoutingRequest("long", req(34, 0).chunk_hashes, 512, 200.0, max_tokens=1000)
    p.on_dispatch(long, "r0", 200.0)
    assert p.choose(half, vs, 201.0).replica_id != "r0"
    # the time per output token is learnt from completions: 999 tokens in 9.99 s = 10 ms
    p.on_first_token(long, "r0", 0.2, 200.2)
    p.on_complete(long, "r0", True, 210.19)
    assert abs(p.stats()["time_per_output_token"]["r0"] - (0.03 + 0.1 * (0.01 - 0.03))) < 1e-9


def test_preble_exploits_the_least_loaded_holder() -> None:
    p = policy("preble")
    for rid in ("r1", "r2"):
        p.on_dispatch(req(35, 0), rid, 0.0)  # both hold the prefix
    p.on_dispatch(RoutingRequest("busy", req(36, 0).chunk_hashes, 512, 0.0, max_tokens=500), "r1", 0.0)
    d = p.choose(req(35, 1), views(r2={"pending_prefill_tokens": 5000}), 1.0)
    # r2 has 5000 tokens pending but less windowed load than r1 (which owes a 500-token answer)
    assert (d.replica_id, d.reason) == ("r2", "exploit")
