"""Members watch each other (controller/sibling_watch.py): who their siblings' reports take
out, and every refusal of the rule."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from controller.sibling_watch import (
    MAX_NAMED,
    QUIET_MS,
    REPORT_INTERVAL_MS,
    WatchedMember,
    bounded_names,
    taken_out,
)

NOW = 1_000_000


def member(bid: str, *, heard_ago: int | None, names: tuple[str, ...] = (), alive: bool = True,
           draining: bool = False) -> WatchedMember:
    """A member last heard (and reporting ``names``) ``heard_ago`` ms before NOW."""
    at = None if heard_ago is None else NOW - heard_ago
    return WatchedMember(key=f"k-{bid}", balancer_id=bid, alive=alive, draining=draining, heard_at_ms=at,
                         named_unresponsive=frozenset(names), report_at_ms=at)


def test_quiet_is_more_than_two_report_intervals() -> None:
    assert 2 * REPORT_INTERVAL_MS < QUIET_MS < 3 * REPORT_INTERVAL_MS


def test_a_quiet_member_every_reporting_sibling_names_is_taken_out() -> None:
    a = member("a", heard_ago=200, names=("b",))
    b = member("b", heard_ago=QUIET_MS)
    c = member("c", heard_ago=900, names=("b", "x"))
    assert taken_out([a, b, c], NOW) == ["k-b"]


def test_one_reporting_sibling_that_does_not_name_it_saves_it() -> None:
    a = member("a", heard_ago=200, names=("b",))
    b = member("b", heard_ago=QUIET_MS + 5000)
    c = member("c", heard_ago=900)
    assert taken_out([a, b, c], NOW) == []


def test_a_member_that_still_reports_is_never_taken_out() -> None:
    # a partition between two siblings that both reach the controller
    a = member("a", heard_ago=100, names=("b",))
    b = member("b", heard_ago=QUIET_MS - 1, names=("a",))
    assert taken_out([a, b], NOW) == []


def test_reports_older_than_quiet_are_no_witness() -> None:
    a = member("a", heard_ago=QUIET_MS, names=("b",))
    b = member("b", heard_ago=QUIET_MS + 10_000)
    assert taken_out([a, b], NOW) == []


def test_the_last_live_member_stays() -> None:
    assert taken_out([member("b", heard_ago=None)], NOW) == []
    # its only sibling is dead or draining: no witness
    dead = member("a", heard_ago=100, names=("b",), alive=False)
    draining = member("c", heard_ago=100, names=("b",), draining=True)
    assert taken_out([dead, member("b", heard_ago=QUIET_MS * 4), draining], NOW) == []


def test_dead_and_draining_members_are_not_taken_out_again() -> None:
    a = member("a", heard_ago=100, names=("b", "c"))
    b = member("b", heard_ago=QUIET_MS * 2, alive=False)
    c = member("c", heard_ago=QUIET_MS * 2, draining=True)
    assert taken_out([a, b, c], NOW) == []


def test_a_member_never_heard_from_is_quiet() -> None:
    a = member("a", heard_ago=100, names=("b",))
    assert taken_out([a, member("b", heard_ago=None)], NOW) == ["k-b"]


def test_ids_not_in_the_region_and_a_long_list_are_ignored() -> None:
    junk = tuple(f"junk-{i}" for i in range(10_000))
    names = bounded_names([*junk, "b"])
    assert len(names) == MAX_NAMED and "b" not in names
    a = WatchedMember("k-a", "a", True, False, NOW - 100, names, NOW - 100)
    assert taken_out([a, member("b", heard_ago=QUIET_MS * 2)], NOW) == []
    a2 = WatchedMember("k-a", "a", True, False, NOW - 100, bounded_names(["b", *junk]), NOW - 100)
    assert taken_out([a2, member("b", heard_ago=QUIET_MS * 2)], NOW) == ["k-b"]


def test_two_quiet_members_named_by_the_one_that_reports_both_go() -> None:
    a = member("a", heard_ago=100, names=("b", "c"))
    b = member("b", heard_ago=QUIET_MS * 2, names=("a",))
    c = member("c", heard_ago=QUIET_MS * 3)
    assert taken_out([a, b, c], NOW) == ["k-b", "k-c"]


def test_heard_recently_without_a_report_is_not_quiet() -> None:
    # a registration (or a good probe) a moment ago counts as heard
    a = member("a", heard_ago=100, names=("b",))
    b = WatchedMember("k-b", "b", True, False, heard_at_ms=NOW - 10, report_at_ms=None)
    assert taken_out([a, b], NOW) == []


@st.composite
def regions(draw: st.DrawFn) -> list[WatchedMember]:
    n = draw(st.integers(min_value=0, max_value=6))
    ids = [f"b{i}" for i in range(n)]
    out = []
    for bid in ids:
        ago = draw(st.one_of(st.none(), st.integers(min_value=0, max_value=3 * QUIET_MS)))
        names = draw(st.frozensets(st.sampled_from([*ids, "junk"]) if ids else st.just("junk"), max_size=4))
        out.append(member(bid, heard_ago=ago, names=tuple(names), alive=draw(st.booleans()),
                          draining=draw(st.booleans())))
    return out


@given(regions())
def test_the_rule_never_breaks_its_refusals(ms: list[WatchedMember]) -> None:
    out = set(taken_out(ms, NOW))
    by_key = {m.key: m for m in ms}
    live = [m for m in ms if m.live]
    assert out <= {m.key for m in live}
    if out:
        assert len(out) < len(live)  # never the last live member
    for key in out:
        x = by_key[key]
        assert x.heard_at_ms is None or NOW - x.heard_at_ms >= QUIET_MS  # it does not report
        witnesses = [m for m in live if m.key != key and m.report_at_ms is not None
                     and NOW - m.report_at_ms < QUIET_MS]
        assert witnesses and all(x.balancer_id in w.named_unresponsive for w in witnesses)
        assert not any(w.key in out for w in witnesses)
