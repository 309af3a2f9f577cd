"""A region of several balancers: what each says it has on every replica (its requests'
prefill still to go) is part of the load its siblings' policies weigh there, and of
nothing a balancer reports as its own; a push counts as seen by a page scraped
``page_lag_s`` after it, and its unit comes back once (docs/routing.md, "A region is a
fleet")."""

from __future__ import annotations

from skymesh.balancer.autoscaling_signal import pending_prefill_s_per_replica
from skymesh.routing.health import ProbeSample
from skymesh.routing.push_shares import ShareState
from skymesh.routing.region import RegionCore
from skymesh.routing.region_actions import SendToReplica
from skymesh.routing.siblings import RegionSiblings, SiblingLoad, SiblingMessage
from tests.test_autoscaling_signal import region_core, req


def sibling_says(core: RegionCore, seq: int, loads: dict[str, SiblingLoad], now: float) -> None:
    shares = ShareState(balancer_id="here-b1", epoch=1, seq=seq, queue_length=0, wants={}, held=frozenset(),
                        claims=frozenset(), grants={}, seen={})
    msg = SiblingMessage(region="here", shares=shares, sent_at=now,
                         pending_prefill_tokens=sum(ld.pending_prefill_tokens for ld in loads.values()),
                         placements_per_s=0.0, loads=loads, placements=())
    assert core.sibling_state(msg, now)


def fleet_member() -> RegionCore:
    """A region core of one of two balancers, alone long enough to hold every unit: the
    push budget never holds a request back here (the units are tests/test_push_shares.py's)."""
    core = region_core(2)
    core.attach_siblings(RegionSiblings("here", "here-b0", 8, dead_after_s=1.0, started_at=-10.0))
    core.sibling_message(0.0)  # a step: alone, it takes every unit
    return core


def placed_on(core: RegionCore, i: int, tokens: int, now: float) -> str:
    assert core.submit(req(i, tokens), now) == []  # queued; the next tick places it
    sends = [a for a in core.tick(now) if isinstance(a, SendToReplica)]
    assert len(sends) == 1, sends
    return sends[0].replica_id


def test_a_sibling_s_prefill_on_a_replica_steers_this_balancer_s_policy_elsewhere() -> None:
    core = fleet_member()
    # nothing anywhere: least_load takes r0 (the tie goes by id)
    assert placed_on(core, 0, 100, 0.0) == "r0"
    # the sibling has 5000 tokens still to prefill on r1, nothing on r0: r0 (100 of ours)
    # is still the less loaded
    sibling_says(core, 1, {"r1": SiblingLoad(2, 2, 5000)}, 0.01)
    assert core.view.replicas["r1"].pending_prefill_tokens == 5000
    assert placed_on(core, 1, 100, 0.02) == "r0"
    # now it says 5000 on r0 and nothing on r1: ours go to r1, which our own figures alone
    # (200 on r0, 0 on r1) would have picked anyway; 50 more on r1 keeps it the lighter
    sibling_says(core, 2, {"r0": SiblingLoad(3, 3, 5000)}, 0.03)
    assert core.view.replicas["r0"].pending_prefill_tokens == 5200
    assert core.view.replicas["r1"].pending_prefill_tokens == 0
    assert placed_on(core, 2, 50, 0.04) == "r1"
    assert placed_on(core, 3, 50, 0.05) == "r1"


def test_the_sibling_s_share_is_never_reported_as_this_balancer_s_own() -> None:
    core = fleet_member()
    rid = placed_on(core, 0, 1000, 0.0)
    sibling_says(core, 1, {rid: SiblingLoad(1, 1, 7000)}, 0.01)
    assert core.view.replicas[rid].pending_prefill_tokens == 8000
    assert core.view.own_pending_prefill(rid) == 1000
    assert core.local.loads()[rid] == SiblingLoad(1, 1, 1000)
    assert core.local.pending_prefill_tokens() == 1000
    # the region's signal counts the sibling's work once: (1000 + 7000) ms over 2 replicas
    assert abs(pending_prefill_s_per_replica(core) - 4.0) < 1e-9
    snap = core.view.snapshot()["replicas"][rid]
    assert snap["pending_prefill_tokens"] == 1000 and snap["region_pending_prefill_tokens"] == 8000
    # its next word drops the share; a silent sibling's share goes with it
    sibling_says(core, 2, {}, 0.02)
    assert core.view.replicas[rid].pending_prefill_tokens == 1000
    sibling_says(core, 3, {rid: SiblingLoad(1, 1, 300)}, 0.03)
    assert core.view.replicas[rid].pending_prefill_tokens == 1300
    core.sibling_message(5.0)  # the next keepalive's step, past dead_after_s: the sibling is gone
    assert core.view.replicas[rid].pending_prefill_tokens == 1000


def one_unit_member() -> RegionCore:
    """A balancer of a region of several holding one unit of its one replica's budget."""
    core = region_core(1)
    core.attach_siblings(RegionSiblings("here", "here-b0", 1, dead_after_s=1.0, started_at=-10.0,
                                        page_lag_s=0.25))
    core.sibling_message(0.0)
    assert core.local.budget.budget_of("r0") == 1
    return core


def sent(core: RegionCore, now: float) -> list[str]:
    return [a.request_id for a in core.tick(now) if isinstance(a, SendToReplica)]


def test_a_page_scraped_page_lag_after_a_push_shows_it_and_its_unit_comes_back_once() -> None:
    core = one_unit_member()
    for i in range(3):
        assert core.submit(req(i, 100), 0.0) == []
    assert sent(core, 0.0) == ["q0"]  # its one unit is spent
    # a page scraped 0.1 s after the push may not show it yet (page_lag_s 0.25)
    core.probe("r0", ProbeSample(num_running=1, sent_at=0.1), 0.12)
    assert sent(core, 0.12) == []
    # one scraped 0.3 s after it does: the unit is free before q0's first token
    core.probe("r0", ProbeSample(num_running=1, sent_at=0.3), 0.31)
    assert sent(core, 0.31) == ["q1"]
    # q0's first token gives nothing back: the page already did
    core.first_token("q0", 0.4)
    assert sent(core, 0.4) == []
    # q1's does (no page showed it yet)
    core.first_token("q1", 0.5)
    assert sent(core, 0.5) == ["q2"]


def test_without_a_send_time_a_push_is_seen_only_at_its_first_token() -> None:
    core = one_unit_member()
    for i in range(2):
        assert core.submit(req(i, 100), 0.0) == []
    assert sent(core, 0.0) == ["q0"]
    core.probe("r0", ProbeSample(num_running=1), 5.0)
    assert sent(core, 5.0) == []
    core.first_token("q0", 5.1)
    assert sent(core, 5.1) == ["q1"]


def test_the_view_reads_siblings_attached_after_it_was_built() -> None:
    """RegionCore.view is built with the core, before any attach_siblings: it reads the
    siblings as attached when it is asked, never a copy taken when it was built."""
    core = region_core(2)
    view = core.view
    assert view.region_pending_prefill_tokens() == 0 and view.heartbeat(0.0).pending_prefill_tokens == 0
    core.attach_siblings(RegionSiblings("here", "here-b0", 8, dead_after_s=1.0, started_at=-10.0))
    core.sibling_message(0.0)
    sibling_says(core, 1, {"r1": SiblingLoad(2, 2, 5000)}, 0.01)
    assert core.view is view
    assert view.region_pending_prefill_tokens() == 5000
    assert view.heartbeat(0.01).pending_prefill_tokens == 5000
