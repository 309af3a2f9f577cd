"""Shared probing in a fleet (skymesh/routing/probe_owners.py): every replica has exactly
one owner among the members, whichever member computes it; a member joining or leaving
moves only the replicas it ranks first on; a silent owner is replaced by rank, one
member at a time; an older or repeated page never overwrites a newer one."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.routing.probe_owners import ProbeOwners, probe_order

REPLICAS = [f"r{i}" for i in range(40)]


def owners_of(members: list[str]) -> dict[str, str]:
    """replica -> its owner, as each member computes it (they must agree)."""
    views = {m: ProbeOwners(m, stale_after_s=0.5) for m in members}
    for v in views.values():
        v.set_members(members)
    out: dict[str, str] = {}
    for rid in REPLICAS:
        (owner,) = [m for m, v in views.items() if v.owns(rid)]
        out[rid] = owner
    return out


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text("abcdefgh-0123", min_size=1, max_size=8), min_size=1, max_size=6, unique=True))
def test_every_replica_has_one_owner_and_a_member_moves_only_its_own(members: list[str]) -> None:
    before = owners_of(members)
    assert set(before.values()) <= set(members)
    joined = owners_of([*members, "newcomer"])
    moved = {rid for rid in REPLICAS if joined[rid] != before[rid]}
    assert all(joined[rid] == "newcomer" for rid in moved)
    if len(members) > 1:
        gone = members[0]
        after = owners_of(members[1:])
        assert all(after[rid] == before[rid] for rid in REPLICAS if before[rid] != gone)


def test_a_fleet_of_three_probes_each_replica_once_per_round() -> None:
    members = ["us-b0", "us-b1", "us-b2"]
    views = [ProbeOwners(m, stale_after_s=0.5) for m in members]
    for v in views:
        v.set_members(members)
    # at the start nobody has seen a page: each member probes what it cannot see
    assert all(v.to_probe(REPLICAS, 0.0) == REPLICAS for v in views)
    for v in views:
        for rid in REPLICAS:
            v.take_page(rid, 0.0)  # each saw its own and its siblings' first pages
    probed: list[str] = []
    for v in views:
        probed += v.to_probe(REPLICAS, 0.1)
    assert sorted(probed) == sorted(REPLICAS)  # once each, over the fleet
    assert all(v.to_probe(REPLICAS, 0.1) for v in views)  # every member has a share of 40


def test_a_silent_owner_is_replaced_by_rank_one_member_at_a_time() -> None:
    members = ["a", "b", "c"]
    rid = "r7"
    order = probe_order(rid, members)
    views = {m: ProbeOwners(m, stale_after_s=0.5) for m in members}
    for v in views.values():
        v.set_members(members)
        v.take_page(rid, 10.0)  # the owner's last page, seen by all
    second, third = order[1], order[2]

    def probers(now: float) -> set[str]:
        return {m for m, v in views.items() if v.to_probe([rid], now)}

    assert probers(10.4) == {order[0]}
    assert probers(10.6) == {order[0], second}  # the next in order takes over
    views[second].take_page(rid, 10.6)  # ... and shares its page
    views[third].take_page(rid, 10.6)
    assert probers(10.9) == {order[0]}  # fresh again: the third never probed
    assert third in probers(11.7)  # both silent past twice the bound: the third too


def test_an_older_page_never_overwrites_a_newer_one() -> None:
    v = ProbeOwners("a", stale_after_s=0.5)
    assert v.take_page("r0", 5.0)
    assert not v.take_page("r0", 5.0)  # repeated
    assert not v.take_page("r0", 4.9)  # older (a slow probe round's answer)
    assert v.take_page("r0", 5.1)
    v.forget(["r1"])
    assert v.take_page("r0", 1.0)  # forgotten with the replica


def test_a_region_of_one_probes_everything() -> None:
    v = ProbeOwners("only", stale_after_s=0.5)
    v.set_members([])
    assert v.to_probe(REPLICAS, 0.0) == REPLICAS
