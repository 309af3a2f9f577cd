"""DualMap's rules: SLO-aware choice, selective pushing, hold then spill, hotspot
migration, adaptive key length."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.base import PolicyContext, ReplicaView, RoutingRequest
from skymesh.routing.hashing import prompt_chunk_hashes
from skymesh.routing.hotness import HotnessTree
from skymesh.routing.policies.dualmap import DualMapPolicy

IDS = [f"r{i}" for i in range(6)]
# estimate = 0.01 s + 1 ms per token of prefill ahead + uncached
CTX = PolicyContext(chunk_tokens=64, ttft_slo_s=1.0, prefill_s_per_token=1e-3, prefill_fixed_s=0.01)


def req(prefix: int, i: int = 0, n: int = 512, arrival: float = 0.0, slo: float | None = None) -> RoutingRequest:
    """``n`` tokens: ``n - 16`` shared by every request of ``prefix``, 16 unique to ``i``."""
    text = " ".join([f"p{prefix}w{k}" for k in range(n - 16)] + [f"u{i}w{k}" for k in range(16)])
    return RoutingRequest(f"{prefix}-{i}", prompt_chunk_hashes(text, 64), n, arrival, slo_ttft_s=slo)


def views(**over: dict) -> dict[str, ReplicaView]:
    out = {rid: ReplicaView(rid) for rid in IDS}
    for rid, fields in over.items():
        for k, v in fields.items():
            setattr(out[rid], k, v)
    return out


def dualmap(**options: object) -> DualMapPolicy:
    p = DualMapPolicy(dataclasses.replace(CTX, options=options))
    p.set_replicas(IDS)
    return p


def holding() -> DualMapPolicy:
    # holding is off by default; these tests exercise the hold/spill/migrate rules alone
    # (waiting for a faster busy candidate, on by default, has tests of its own)
    return dualmap(max_hold_fraction=0.5, wait_for_faster_candidate=False)


def other_of(p: DualMapPolicy, r: RoutingRequest, c: str) -> str:
    c1, c2 = p.candidates(r)
    return c2 if c == c1 else c1


def test_candidates_are_two_distinct_replicas_shared_by_a_prefix() -> None:
    p = dualmap()
    c1, c2 = p.candidates(req(1, 0))
    assert c1 != c2 and {c1, c2} <= set(IDS)
    # same first chunk (the base key) → the same pair, whatever the user turn
    assert all(p.candidates(req(1, i)) == (c1, c2) for i in range(1, 10))


def test_escapes_to_any_replica_when_both_candidates_break_the_slo() -> None:
    r = req(9)
    p = dualmap()
    c1, c2 = p.candidates(r)
    third = next(rid for rid in IDS if rid not in (c1, c2))
    busy = {rid: {"pending_prefill_tokens": 5000} for rid in IDS if rid != third}
    busy[third] = {"pending_prefill_tokens": 100}
    d = p.choose(r, views(**busy), 0.0)
    assert (d.replica_id, d.reason) == (third, "escape")
    # with the escape off, the better of the two candidates is taken even though it misses
    d = dualmap(escape_over_slo=False).choose(r, views(**busy), 0.0)
    assert d.replica_id in (c1, c2) and d.reason == "slo"
    # a candidate within the SLO is never escaped from
    busy[c1] = {"pending_prefill_tokens": 200}
    assert dualmap().choose(r, views(**busy), 0.0).replica_id == c1


def test_equal_hits_pick_the_less_loaded_candidate() -> None:
    p = dualmap()
    r = req(7)
    c1, c2 = p.candidates(r)
    assert p.choose(r, views(**{c1: {"pending_prefill_tokens": 300}}), 0.0).replica_id == c2
    assert p.choose(r, views(**{c2: {"pending_prefill_tokens": 300}}), 0.0).replica_id == c1


def test_keeps_cache_affinity_while_the_slo_holds_then_switches() -> None:
    p = dualmap()
    r0 = req(8, 0)
    c1, c2 = p.candidates(r0)
    p.on_dispatch(r0, c2, 0.0)  # c2 now holds the 496-token prefix
    r1 = req(8, 1)
    # affine c2 is more loaded but its estimate 0.01 + 1e-3 * (400 + 32) = 0.44 s <= 1 s
    d = p.choose(r1, views(**{c2: {"pending_prefill_tokens": 400}}), 0.0)
    assert (d.replica_id, d.reason) == (c2, "affinity")
    assert d.matched_tokens == 448 and abs(d.estimated_ttft_s - 0.01 - 0.464) < 1e-9
    # once its estimate breaks the SLO (1e-3 * 1500 > 1 s), the lower estimate wins
    d = p.choose(r1, views(**{c2: {"pending_prefill_tokens": 1500}}), 0.0)
    assert (d.replica_id, d.reason) == (c1, "slo")


def test_the_requests_own_slo_overrides_the_default() -> None:
    p = dualmap()
    r0 = req(13, 0)
    c1, c2 = p.candidates(r0)
    p.on_dispatch(r0, c2, 0.0)
    # affine estimate 0.01 + 1e-3 * (600 + 64) = 0.674 s, the other 0.01 + 0.512 = 0.522 s
    loaded = views(**{c2: {"pending_prefill_tokens": 600}})
    assert p.choose(req(13, 1), loaded, 0.0).replica_id == c2  # within the default 1 s
    assert p.choose(req(13, 2, slo=0.5), loaded, 0.0).replica_id == c1


@settings(max_examples=40, deadline=None)
@given(
    busy=st.sets(st.sampled_from(IDS), max_size=5),
    pending=st.lists(st.integers(0, 3000), min_size=6, max_size=6),
    prefix=st.integers(0, 30),
    hold=st.booleans(),
)
def test_only_an_available_healthy_replica_or_none_is_returned(
    busy: set[str], pending: list[int], prefix: int, hold: bool
) -> None:
    p = holding() if hold else dualmap()
    vs = views(**{rid: {"pending_prefill_tokens": pending[i]} for i, rid in enumerate(IDS)})
    for rid in busy:
        vs[rid].available = False
    vs[IDS[prefix % 6]].healthy = False  # unhealthy but "available": never chosen
    d = p.choose(req(prefix), vs, 0.0)
    if d.reason == "wait_for_candidate":  # held for a busy candidate estimated faster
        assert d.replica_id is None
        assert any(not vs[c].available and vs[c].healthy for c in p.candidates(req(prefix)))
    elif d.replica_id is None:
        assert not any(vs[c].available and vs[c].healthy for c in p.candidates(req(prefix)))
        if d.reason != "hold":  # spilling found nobody either
            assert not any(v.available and v.healthy for v in vs.values())
        else:
            assert hold
    else:
        assert vs[d.replica_id].available and vs[d.replica_id].healthy


def test_an_available_candidate_is_taken_when_the_other_is_busy() -> None:
    p = holding()
    r0 = req(14, 0)
    c1, c2 = p.candidates(r0)
    p.on_dispatch(r0, c2, 0.0)  # c2 is cache-affine but busy: selective pushing → c1
    d = p.choose(req(14, 1), views(**{c2: {"available": False}}), 0.0)
    assert d.replica_id == c1


def test_holds_for_its_candidates_then_spills_to_the_best_hit() -> None:
    p = holding()
    r = req(9, arrival=0.0)
    c1, c2 = p.candidates(r)
    warm = next(x for x in IDS if x not in (c1, c2))
    p.on_dispatch(req(9, 99), warm, 0.0)  # a non-candidate holds the prefix
    busy = views(**{c1: {"available": False}, c2: {"available": False}})
    d = p.choose(r, busy, 0.0)
    assert d.replica_id is None and d.reason == "hold"
    assert p.held_for(r.request_id) in (c1, c2)
    assert p.stats()["held"] == 1
    # estimate 0.01 + 0.512 s: slack 0.478 s, half of it 0.239 s; waited 0.2 s → hold
    assert p.choose(r, busy, 0.2).replica_id is None
    d = p.choose(r, busy, 0.9)  # waited 0.9 s of a 1 s SLO: spill to the replica with the hit
    assert (d.replica_id, d.reason) == (warm, "spill")
    assert d.matched_tokens == 448 and p.held_for(r.request_id) is None


def test_spill_without_hits_goes_to_the_least_loaded() -> None:
    p = dualmap()  # default: no holding at all
    r = req(12, arrival=0.0)
    c1, c2 = p.candidates(r)
    busy = views(**{c1: {"available": False}, c2: {"available": False}})
    for rid in IDS:
        busy[rid].pending_prefill_tokens = 500
    idle = next(x for x in IDS if x not in (c1, c2))
    busy[idle].pending_prefill_tokens = 10
    d = p.choose(r, busy, 0.0)
    assert (d.replica_id, d.reason) == (idle, "spill")


def test_nothing_available_at_all_returns_none() -> None:
    p = dualmap()
    d = p.choose(req(3), views(**{rid: {"available": False} for rid in IDS}), 5.0)
    assert d.replica_id is None


def held_request(p: DualMapPolicy, prefix: int) -> tuple[RoutingRequest, str, str]:
    r = req(prefix, arrival=0.0)
    c1, c2 = p.candidates(r)
    busy = views(**{c1: {"available": False}, c2: {"available": False}})
    assert p.choose(r, busy, 0.0).replica_id is None
    held_for = p.held_for(r.request_id)
    return r, held_for, other_of(p, r, held_for)


@settings(max_examples=40, deadline=None)
@given(pend_i=st.integers(0, 3000), pend_j=st.integers(0, 3000), waited=st.floats(0.0, 0.9))
def test_migrates_exactly_when_benefit_is_positive_and_the_target_meets_the_slo(
    pend_i: int, pend_j: int, waited: float
) -> None:
    p = holding()
    r, held_for, other = held_request(p, 10)
    vs = views(**{held_for: {"available": False, "pending_prefill_tokens": pend_i},
                  other: {"available": False, "pending_prefill_tokens": pend_j}})
    # no cached prefix anywhere: both would prefill all 512 tokens
    ttft_i = 0.01 + 1e-3 * (pend_i + 512)
    ttft_j = 0.01 + 1e-3 * (pend_j + 512)
    should = ttft_i - ttft_j > 0 and waited + ttft_j < 1.0
    moves = p.rebalance([r], vs, waited)
    assert bool(moves) == should
    if should:
        (m,) = moves
        assert (m.request_id, m.from_replica, m.to_replica) == (r.request_id, held_for, other)
        assert abs(m.benefit_s - (ttft_i - ttft_j)) < 1e-9
        assert p.held_for(r.request_id) == other and p.stats()["migrations"] == 1
    else:
        assert p.held_for(r.request_id) == held_for


def test_after_migration_the_new_target_is_preferred() -> None:
    p = holding()
    r, held_for, other = held_request(p, 15)
    vs = views(**{held_for: {"available": False, "pending_prefill_tokens": 900},
                  other: {"available": False, "pending_prefill_tokens": 0}})
    assert len(p.rebalance([r], vs, 0.0)) == 1
    # both free again, the old target even less loaded: the migrated request goes where
    # it was moved
    free = views(**{held_for: {"pending_prefill_tokens": 0}, other: {"pending_prefill_tokens": 100}})
    d = p.choose(r, free, 0.1)
    assert d.replica_id == other


def test_rebalance_counts_work_already_held_for_a_replica() -> None:
    p = holding()
    reqs = [req(16, i) for i in range(4)]
    c1, c2 = p.candidates(reqs[0])
    busy = views(**{c1: {"available": False}, c2: {"available": False}})
    for r in reqs:
        assert p.choose(r, busy, 0.0).replica_id is None
    held_for = p.held_for(reqs[0].request_id)
    vs = views(**{held_for: {"available": False, "pending_prefill_tokens": 200},
                  other_of(p, reqs[0], held_for): {"available": False, "pending_prefill_tokens": 0}})
    moves = p.rebalance(reqs, vs, 0.0)
    # moving every request would just pile them up on the other candidate: some stay
    assert 0 < len(moves) < len(reqs)


def test_rebalance_forgets_requests_no_longer_queued() -> None:
    p = holding()
    r, _, _ = held_request(p, 17)
    assert p.rebalance([], views(), 0.0) == []
    assert p.held_for(r.request_id) is None


def test_removed_replicas_are_forgotten() -> None:
    p = holding()
    r, held_for, _ = held_request(p, 18)
    p.on_dispatch(req(18, 5), held_for, 0.0)
    p.set_replicas([x for x in IDS if x != held_for])
    assert p.held_for(r.request_id) is None
    assert p.cache.match_per_target(req(18, 6).chunk_hashes, [held_for]) == {held_for: 0}
    assert held_for not in p.candidates(r)


def test_first_tokens_refit_the_ttft_model() -> None:
    p = dualmap()
    for i in range(600):
        r = req(19, i)
        vs = views(**{rid: {"pending_prefill_tokens": (i * 37 + k * 301) % 2000} for k, rid in enumerate(IDS)})
        d = p.choose(r, vs, float(i))
        p.on_dispatch(r, d.replica_id, float(i))
        # the real replica is 4x slower per token than the seed
        work = vs[d.replica_id].pending_prefill_tokens + r.prompt_tokens - d.matched_tokens
        p.on_first_token(r, d.replica_id, 0.01 + 4e-3 * work, float(i))
    assert p.estimator.observations == 600
    assert abs(p.stats()["ttft_model"]["s_per_token"] - 4e-3) < 4e-4


def test_a_hot_prefix_spreads_beyond_one_pair() -> None:
    p = dualmap()
    used = set()
    for i in range(300):
        r = req(11, i)  # one very popular system prompt, distinct user turns
        d = p.choose(r, views(), float(i))
        assert d.replica_id is not None
        p.on_dispatch(r, d.replica_id, float(i))
        used.add(d.replica_id)
    assert len(used) > 2 and p.stats()["hot_prefixes"] >= 1


def test_a_seconds_window_cools_a_prefix_once_its_traffic_stops() -> None:
    p = dualmap(hotness_window_s=10.0)
    for i in range(100):
        r = req(20, i)
        p.on_dispatch(r, p.choose(r, views(), i * 0.01).replica_id, i * 0.01)
    assert p.hotness.key_length(req(20, 0).chunk_hashes, 6) > 1
    p.choose(req(21), views(), 100.0)  # much later: the window is empty again
    assert p.hotness.key_length(req(20, 0).chunk_hashes, 6) == 1
    assert p.stats()["window_requests"] == 0


def test_hotness_hysteresis_hot_above_two_over_n_cool_below_one_over_n() -> None:
    n = 10  # hot above 20% of the window, cooled below 10%
    h = HotnessTree(base_chunks=1, window=100)
    hot_prompt = (1, 2, 3)

    def traffic(hot_share: float, count: int, start: int) -> None:
        for i in range(start, start + count):
            # spread evenly (Bresenham), so no stretch of the window is denser than the share
            if int((i - start + 1) * hot_share) > int((i - start) * hot_share):
                h.observe((1, 10_000 + i, 20_000 + i), n)
            else:
                h.observe((50_000 + i, 60_000 + i), n)

    traffic(0.15, 100, 0)  # 15% < 20%: never becomes hot
    assert h.key_length(hot_prompt, n) == 1
    traffic(0.30, 100, 100)  # 30% > 20%: hot, keyed one chunk deeper
    assert 1 in h.hot and h.key_length(hot_prompt, n) == 2
    traffic(0.15, 100, 200)  # between 10% and 20%: stays hot (hysteresis)
    assert 1 in h.hot
    traffic(0.05, 100, 300)  # below 10%: cooled
    assert 1 not in h.hot and h.key_length(hot_prompt, n) == 1


def test_waits_for_a_busy_affine_candidate_only_while_that_is_faster() -> None:
    p = dualmap(wait_for_faster_candidate=True)
    r0 = req(21, 0)
    c1, c2 = p.candidates(r0)
    p.on_dispatch(r0, c2, 0.0)  # c2 holds the 496-token prefix
    r1, r2 = req(21, 1), req(21, 2)
    # c2 busy with 100 tokens ahead: 0.01 + 1e-3 * (100 + 64) = 0.174 s against c1's
    # 0.01 + 0.512 s with nothing cached: wait for c2
    busy = views(**{c2: {"available": False, "pending_prefill_tokens": 100}})
    d = p.choose(r1, busy, 0.0)
    assert (d.replica_id, d.reason) == (None, "wait_for_candidate") and p.held_for(r1.request_id) == c2
    # the second waits too, behind the first's 64 uncached tokens (0.238 s)
    assert p.choose(r2, busy, 0.0).replica_id is None
    assert p._backlog[c2] == 128
    # once c2 is available again the held request goes there
    d = p.choose(r1, views(**{c2: {"pending_prefill_tokens": 100}}), 0.1)
    assert (d.replica_id, d.matched_tokens) == (c2, 448)
    assert p.held_for(r1.request_id) is None and p._backlog[c2] == 64
    # c2 busy with 1,000 tokens ahead (1.07 s) is slower than c1 now: no more waiting
    d = p.choose(r2, views(**{c2: {"available": False, "pending_prefill_tokens": 1000}}), 0.2)
    assert d.replica_id == c1 and c2 not in p._backlog and p.stats()["held"] == 0
    # without the option the free candidate is taken at once (plain selective pushing)
    q = dualmap(wait_for_faster_candidate=False)
    q.on_dispatch(r0, c2, 0.0)
    assert q.choose(req(21, 3), busy, 0.0).replica_id == c1


def test_a_waiting_request_that_completes_or_leaves_frees_its_backlog() -> None:
    p = dualmap(wait_for_faster_candidate=True)
    r0 = req(22, 0)
    c1, c2 = p.candidates(r0)
    p.on_dispatch(r0, c2, 0.0)
    busy = views(**{c2: {"available": False, "pending_prefill_tokens": 100}})
    r1, r2 = req(22, 1), req(22, 2)
    assert p.choose(r1, busy, 0.0).replica_id is None and p.choose(r2, busy, 0.0).replica_id is None
    p.on_complete(r1, c2, False, 0.1)  # cancelled while waiting
    assert p._backlog[c2] == 64
    p.rebalance([], busy, 0.2)  # r2 left the queue too
    assert not p._backlog and p.stats()["held"] == 0
