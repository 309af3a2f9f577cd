"""The push budget on its own (skymesh/routing/push_budget.py): a region of one balancer
credits pushes by the page's count and never waits for a lease; attaching siblings
credits them by time and pushes within the units held."""

from __future__ import annotations

from skymesh.routing.push_budget import CountCredit, PushBudget, TimeCredit
from skymesh.routing.siblings import RegionSiblings


def lone(budget: int = 2) -> PushBudget:
    b = PushBudget(budget)
    b.add_replica("r0")
    return b


def in_fleet(budget: int = 2, page_lag_s: float = 0.25) -> PushBudget:
    b = lone(budget)
    siblings = RegionSiblings("here", "here-b0", budget, dead_after_s=1.0, started_at=-10.0, page_lag_s=page_lag_s)
    siblings.shares.set_replicas(["r0"])
    siblings.step(0.0, {}, {})  # alone: it takes every unit
    b.attach_siblings(siblings)
    return b


def test_alone_the_whole_budget_is_here_and_a_pick_never_waits_for_a_lease() -> None:
    b = lone(2)
    assert isinstance(b.rule, CountCredit) and not b.shared
    assert b.budget_of("r0") == 2 and b.free_slots("r0") == 2
    b.pushed("r0", 0.0)
    b.pushed("r0", 0.1)
    assert not b.free_here("r0") and b.free_slots("r0") == 0
    assert not b.awaits_lease("r0")  # nothing to lease: the whole budget is this balancer's
    assert not b.refresh("r0")  # no room: the replica is not available


def test_alone_a_page_s_count_credits_the_oldest_pushes_and_each_unit_comes_back_once() -> None:
    b = lone(2)
    b.pushed("r0", 0.0)
    b.pushed("r0", 0.1)
    # the page shows one of the two (running 1, none started here): one stays charged
    b.on_page("r0", healthy=True, in_flight=2, num_running=1, num_waiting=0, sent_at=None)
    assert b.charged("r0") == 1
    # the first push starts: the page showed it (the oldest), nothing comes back
    b.unit_back("r0", 0.0)
    assert b.charged("r0") == 1
    # the second starts: the page did not show it, its unit comes back
    b.unit_back("r0", 0.1)
    assert b.charged("r0") == 0


def test_in_a_fleet_a_page_credits_the_pushes_made_page_lag_before_its_scrape() -> None:
    b = in_fleet(2, page_lag_s=0.25)
    assert isinstance(b.rule, TimeCredit) and b.shared
    assert b.budget_of("r0") == 2
    b.pushed("r0", 0.0)
    b.pushed("r0", 0.5)
    # scraped at 0.5: shows what was pushed by 0.25 whatever its count says
    b.on_page("r0", healthy=True, in_flight=2, num_running=9, num_waiting=0, sent_at=0.5)
    assert b.charged("r0") == 1
    b.unit_back("r0", 0.0)  # shown: nothing back
    assert b.charged("r0") == 1
    b.unit_back("r0", 0.5)  # not shown: its unit comes back
    assert b.charged("r0") == 0
    # a scrape of unknown time shows nothing: every unstarted push stays charged
    b.pushed("r0", 1.0)
    b.on_page("r0", healthy=True, in_flight=1, num_running=1, num_waiting=0, sent_at=None)
    assert b.charged("r0") == 1


def test_in_a_fleet_a_pick_without_a_unit_here_waits_for_a_lease() -> None:
    b = in_fleet(2)
    b.pushed("r0", 0.0)
    b.pushed("r0", 0.1)
    assert b.awaits_lease("r0")


def test_a_hold_charges_the_whole_budget_and_a_failed_probe_clears_it() -> None:
    b = lone(3)
    b.hold("r0")
    assert b.charged("r0") == 3 and b.push_rate("r0", 1.0, 0.1) == 0.0  # no push spent it
    b.on_page("r0", healthy=False, in_flight=0, num_running=0, num_waiting=0, sent_at=None)
    assert b.charged("r0") == 0 and b.push_rate("r0", 1.0, 0.1) == 30.0
