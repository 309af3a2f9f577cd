"""Shared push budgets by leases (skymesh/routing/push_shares.py): however siblings'
messages are delayed, reordered across links or lost, whichever member dies or stalls
past every timeout and resumes, with clocks apart by less than the skew margin, no unit is
ever in use by two balancers; with messages flowing every unit of every replica is held;
a replica's units are lent to the sibling that wants it; one balancer alone holds the
whole budget; a silent member's units are taken only once the topology drops it."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from skymesh.routing.push_shares import PushShares, ShareState, Unit

REPLICAS = ("r0", "r1", "r2", "r3", "r4")
LEASE_S = 0.3
SKEW_MARGIN_S = 0.1
STALL_FENCE_S = 0.2


@dataclass
class Fleet:
    """N balancers exchanging their states over per-link FIFO channels with delays, with a
    controller that drops a member silent for long and lists it again once it speaks."""

    shares: list[PushShares]
    rng: random.Random
    loss: float = 0.0
    queues: dict[str, int] = field(default_factory=dict)
    wants: dict[str, dict[str, int]] = field(default_factory=dict)
    unseen: dict[str, dict[str, int]] = field(default_factory=dict)
    # per balancer: its wall clock's offset (the receiver rebases a message's age by it)
    skew: dict[str, float] = field(default_factory=dict)
    # (src, dst) -> [(deliver_at, sent_at true time, state)], delivered in order
    links: dict[tuple[str, str], list[tuple[float, float, ShareState]]] = field(
        default_factory=lambda: defaultdict(list))
    stalled: set[str] = field(default_factory=set)  # loops standing still (no step, no send)
    dead: set[str] = field(default_factory=set)
    silent_since: dict[str, float] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)  # the topology calls them dead
    now: float = 0.0

    @classmethod
    def of(cls, n: int, budget: int, seed: int, loss: float = 0.0, max_skew: float = 0.0) -> Fleet:
        rng = random.Random(seed)
        shares = [PushShares(f"b{i}", budget, dead_after_s=LEASE_S, lease_s=LEASE_S, skew_margin_s=SKEW_MARGIN_S,
                             stall_fence_s=STALL_FENCE_S) for i in range(n)]
        for s in shares:
            s.set_replicas(REPLICAS)
            s.set_members(o.balancer_id for o in shares)
        return cls(shares, rng, loss,
                   queues={s.balancer_id: 0 for s in shares},
                   wants={s.balancer_id: {} for s in shares},
                   unseen={s.balancer_id: {} for s in shares},
                   skew={s.balancer_id: rng.uniform(-max_skew / 2, max_skew / 2) for s in shares})

    def running(self) -> list[PushShares]:
        return [s for s in self.shares if s.balancer_id not in self.stalled | self.dead]

    def send_all(self, max_delay: float) -> None:
        for s in self.running():
            msg = s.message(self.queues[s.balancer_id], self.wants[s.balancer_id], self.now)
            for o in self.shares:
                if o is s or self.rng.random() < self.loss:
                    continue
                link = self.links[(s.balancer_id, o.balancer_id)]
                at = max([self.now + self.rng.uniform(0, max_delay)] + [t for t, _, _ in link[-1:]])
                link.append((at, self.now, msg))

    def deliver_due(self) -> None:
        by_id = {s.balancer_id: s for s in self.shares}
        for (src, dst), link in self.links.items():
            if dst in self.stalled:
                continue  # waits in its socket
            while link and link[0][0] <= self.now:
                _, sent, msg = link.pop(0)
                if dst in self.dead:
                    continue
                # the daemon's rebasing: the age the wall clocks tell, never below 0
                age = max(0.0, (self.now + self.skew[dst]) - (sent + self.skew[src]))
                by_id[dst].on_message(replace(msg, sent_at=self.now - age), self.now)

    def step_all(self) -> None:
        for s in self.running():
            s.step(self.now, self.unseen[s.balancer_id], self.wants[s.balancer_id])

    def controller(self) -> None:
        """Drops a member silent (stalled, dead) for long; lists it again once it runs."""
        for s in self.shares:
            sid = s.balancer_id
            if sid in self.stalled | self.dead:
                self.silent_since.setdefault(sid, self.now)
                if self.now - self.silent_since[sid] > 3 * STALL_FENCE_S:
                    self.dropped.add(sid)
            else:
                self.silent_since.pop(sid, None)
                if sid in self.dropped and self.rng.random() < 0.3:
                    self.dropped.discard(sid)  # it registered again
        listed = [s.balancer_id for s in self.shares if s.balancer_id not in self.dropped]
        for s in self.running():
            if self.rng.random() < 0.5:  # the topology reaches each member in its own time
                s.set_members(listed, self_listed=s.balancer_id not in self.dropped)
                s.topology_heard()

    def use_units(self) -> None:
        """Each balancer pushes within what it may use, and sees some pushes show up."""
        for s in self.running():
            mine = self.unseen[s.balancer_id]
            for r in REPLICAS:
                n = mine.get(r, 0)
                if n > s.units_on(r) and self.rng.random() < 0.5:
                    n = s.units_on(r)  # a probe shows some
                if self.rng.random() < 0.3 and n < s.units_on(r):
                    n += 1
                elif self.rng.random() < 0.3 and n > 0:
                    n -= 1
                mine[r] = n

    def in_use(self) -> dict[Unit, list[str]]:
        out: dict[Unit, list[str]] = defaultdict(list)
        for s in self.running():
            for u in s.units_in_use():
                out[u].append(s.balancer_id)
        return out

    def holders(self) -> dict[Unit, list[str]]:
        out: dict[Unit, list[str]] = defaultdict(list)
        for s in self.shares:
            for u in s.held:
                out[u].append(s.balancer_id)
        return out

    def assert_exclusive(self) -> None:
        for unit, ids in self.in_use().items():
            assert len(ids) == 1, f"{unit} in use by {ids} at t={self.now:.3f}"
        for r in REPLICAS:
            usable = sum(s.units_on(r) for s in self.running())
            assert usable <= self.shares[0].budget, f"{r}: {usable} units usable at t={self.now:.3f}"

    def tick(self, dt: float, max_delay: float) -> None:
        self.now += dt
        self.deliver_due()
        self.controller()
        self.step_all()
        self.assert_exclusive()
        self.send_all(max_delay)


@settings(max_examples=60, deadline=None)
@example(n=4, budget=1, seed=0, loss=0.5, max_delay=0.05, faults=False)
@example(n=3, budget=2, seed=1, loss=0.2, max_delay=0.05, faults=True)
@given(n=st.integers(2, 4), budget=st.integers(1, 3), seed=st.integers(0, 10_000),
       loss=st.sampled_from([0.0, 0.2, 0.5]), max_delay=st.sampled_from([0.001, 0.05, 0.15]),
       faults=st.booleans())
def test_no_unit_is_ever_in_use_twice_whatever_befalls_messages_members_and_clocks(
        n: int, budget: int, seed: int, loss: float, max_delay: float, faults: bool) -> None:
    fleet = Fleet.of(n, budget, seed, loss, max_skew=SKEW_MARGIN_S if faults else 0.0)
    rng = random.Random(seed + 1)
    for _ in range(400):
        if rng.random() < 0.1:  # queues and wants come and go: leases are granted and recalled
            who = rng.choice(fleet.shares).balancer_id
            fleet.queues[who] = rng.choice([0, 0, 1, 5, 20])
            fleet.wants[who] = {r: rng.choice([0, 1, 3]) for r in REPLICAS} if fleet.queues[who] else {}
        if faults and rng.random() < 0.02:
            who = rng.choice(fleet.shares).balancer_id
            if who in fleet.stalled:
                fleet.stalled.discard(who)  # its loop resumes, its clock far ahead
            elif who in fleet.dead:
                pass
            elif rng.random() < 0.7:
                fleet.stalled.add(who)  # frozen past every timeout
            else:
                fleet.dead.add(who)
        fleet.use_units()
        fleet.tick(rng.uniform(0.001, 0.05), max_delay)


def settle(fleet: Fleet, rounds: int = 40) -> None:
    for _ in range(rounds):
        fleet.tick(0.01, 0.002)


def idle(fleet: Fleet, seconds: float) -> None:
    settle(fleet, int(seconds / 0.01) + 1)


@pytest.mark.parametrize("n", [2, 3])
def test_with_messages_flowing_every_unit_is_held_once(n: int) -> None:
    fleet = Fleet.of(n, 2, seed=7)
    settle(fleet)
    holders = fleet.holders()
    assert sorted(holders) == sorted(Unit(r, i) for r in REPLICAS for i in range(2))
    per_balancer = {s.balancer_id: len(s.held) for s in fleet.shares}
    # homes spread the units: nobody holds them all, everybody with a home holds some
    assert max(per_balancer.values()) < 2 * len(REPLICAS)
    assert sum(per_balancer.values()) == 2 * len(REPLICAS)


def test_units_of_a_replica_are_leased_to_the_sibling_that_wants_it_and_come_back() -> None:
    fleet = Fleet.of(2, 2, seed=3)
    settle(fleet)
    b0, b1 = fleet.shares
    assert all(b0.units_on(r) >= 1 and b1.units_on(r) >= 1 for r in REPLICAS)  # one each at least
    fleet.queues["b1"] = 10
    settle(fleet)
    assert all(b1.units_on(r) <= 1 for r in REPLICAS)  # a queue alone wants nothing in particular
    fleet.wants["b1"] = {"r0": 4, "r1": 1}
    settle(fleet)
    assert b1.units_on("r0") == 2 and b1.units_on("r1") == 2 and b0.units_on("r0") == 0
    assert all(b0.units_on(r) + b1.units_on(r) == 2 for r in REPLICAS[2:])  # what nobody wants stays home
    # b0 wants r0 itself: its unit is recalled; r1 stays lent (renewed while b1 wants it)
    fleet.queues["b0"] = 3
    fleet.wants["b0"] = {"r0": 1}
    settle(fleet)
    assert b0.units_on("r0") == 1 and b1.units_on("r0") == 1 and b1.units_on("r1") == 2
    idle(fleet, 3 * LEASE_S)  # renewed, not expired
    assert b1.units_on("r1") == 2
    # b1's queue empties: its leases go back once idle, and b0, still wanting r0, borrows b1's
    fleet.queues["b1"], fleet.wants["b1"] = 0, {}
    idle(fleet, 2 * LEASE_S)
    assert b0.units_on("r0") == 2 and b1.units_on("r0") == 0
    assert all(b0.units_on(r) == 1 and b1.units_on(r) == 1 for r in REPLICAS[1:])
    fleet.assert_exclusive()


def test_members_sharing_a_replicas_units_lend_only_what_stayed_unused_a_while() -> None:
    """Two members hold one unit each of every replica. One pushes on its unit of r0 in
    every other round while the other wants r0: the unit is free only between pushes, and
    is not lent into those gaps (a grant and a recall each time, for nothing); left
    unused for ``want_memory_s``, it is lent."""
    fleet = Fleet.of(2, 2, seed=3)
    settle(fleet)
    b0, b1 = fleet.shares
    assert b0.units_on("r0") == 1 and b1.units_on("r0") == 1
    fleet.queues["b1"], fleet.wants["b1"] = 5, {"r0": 1}
    for i in range(30):
        fleet.unseen["b0"]["r0"] = i % 2  # pushed, then seen: free at every other step
        fleet.tick(0.01, 0.002)
        assert b1.units_on("r0") == 1 and not b0.grants, f"lent into a gap at t={fleet.now:.2f}"
    fleet.unseen["b0"]["r0"] = 0
    idle(fleet, b0.want_memory_s + 0.05)
    assert b1.units_on("r0") == 2 and b0.units_on("r0") == 0


def test_a_member_with_no_unit_of_a_replica_borrows_it_at_once() -> None:
    """Budget 1: each replica's one unit has one home. The other member, wanting it, gets
    it as soon as the home's push on it was seen (it has no unit of its own there)."""
    fleet = Fleet.of(2, 1, seed=3)
    settle(fleet)
    b0, b1 = fleet.shares
    r = next(r for r in REPLICAS if b0.units_on(r) == 1)
    fleet.unseen["b0"][r] = 1
    fleet.tick(0.01, 0.002)
    fleet.unseen["b0"][r] = 0  # seen
    fleet.queues["b1"], fleet.wants["b1"] = 5, {r: 1}
    settle(fleet, 5)
    assert b1.units_on(r) == 1 and b0.units_on(r) == 0


def test_a_recalled_lease_in_use_is_given_back_only_once_free() -> None:
    fleet = Fleet.of(2, 1, seed=5)
    fleet.queues["b1"] = 10
    fleet.wants["b1"] = dict.fromkeys(REPLICAS, 1)
    settle(fleet)
    b0, b1 = fleet.shares
    leased = sorted(b1.leases)
    assert leased, "b0 lent nothing"
    unit = leased[0]
    fleet.unseen["b1"][unit.replica_id] = 1  # b1 pushed with it: the push is unseen yet
    fleet.queues["b0"] = 4  # b0 wants it back
    fleet.wants["b0"] = {unit.replica_id: 1}
    for _ in range(20):
        fleet.now += 0.01
        fleet.deliver_due()
        fleet.step_all()
        fleet.assert_exclusive()
        fleet.send_all(0.002)
    assert unit in b1.held and unit not in b0.units_in_use()
    assert b1.units_on(unit.replica_id) == 0  # recalled: no new push on it
    fleet.unseen["b1"][unit.replica_id] = 0  # the probe shows it: the unit is free
    settle(fleet)
    assert unit in b0.held and unit not in b1.held


def test_a_lease_ends_on_the_borrowers_clock_when_its_home_falls_silent() -> None:
    fleet = Fleet.of(2, 1, seed=8)
    fleet.queues["b1"] = 10
    fleet.wants["b1"] = dict.fromkeys(REPLICAS, 1)
    settle(fleet)
    b1 = fleet.shares[1]
    assert b1.leases
    fleet.dead.add("b0")
    fleet.controller = lambda: None  # type: ignore[method-assign]  # no controller: b0 stays listed
    idle(fleet, LEASE_S + 0.05)
    assert not b1.leases  # nothing renews them
    # b0's home units stay b0's: no timeout alone hands them to b1
    idle(fleet, 20 * LEASE_S)
    assert sum(b1.units_on(r) for r in REPLICAS) == len(b1.home_held) < len(REPLICAS)


def test_one_balancer_alone_holds_the_whole_budget_after_its_grace() -> None:
    s = PushShares("b0", 2, dead_after_s=0.3, lease_s=0.5, skew_margin_s=0.1)
    s.set_replicas(REPLICAS)
    s.set_members(["b1"])  # configured, never heard
    s.step(0.1, {}, {})
    s.message(0, {}, 0.1)
    s.step(0.2, {}, {})
    assert s.units_on("r0") == 0  # b1 may be up and holding: wait to hear it
    s.set_members([])  # the topology lists b0 alone
    s.step(0.3, {}, {})
    s.message(0, {}, 0.3)
    s.step(0.4, {}, {})
    assert all(s.units_on(r) == 2 for r in REPLICAS)


def test_a_silent_members_units_are_taken_only_once_the_topology_drops_it() -> None:
    fleet = Fleet.of(2, 2, seed=11)
    listed = ["b0", "b1"]
    fleet.controller = lambda: [s.set_members(listed) for s in fleet.running()]  # type: ignore[method-assign,func-returns-value]
    settle(fleet)
    b0, b1 = fleet.shares
    assert any(b1.units_on(r) for r in REPLICAS)
    fleet.dead.add("b1")
    idle(fleet, 10 * LEASE_S)
    assert sum(b0.units_on(r) for r in REPLICAS) == len(REPLICAS)  # its own only
    listed.remove("b1")  # the controller called b1 dead
    idle(fleet, 2 * (LEASE_S + SKEW_MARGIN_S))
    assert all(b0.units_on(r) == 2 for r in REPLICAS)


def test_a_stalled_member_fences_its_home_units_until_it_hears_the_topology() -> None:
    fleet = Fleet.of(2, 2, seed=12)
    listed = ["b0", "b1"]
    fleet.controller = lambda: None  # type: ignore[method-assign]
    settle(fleet)
    b0, b1 = fleet.shares
    fleet.stalled.add("b1")
    idle(fleet, 5 * STALL_FENCE_S)
    listed.remove("b1")
    b0.set_members(listed)
    b0.topology_heard()
    idle(fleet, 2 * (LEASE_S + SKEW_MARGIN_S))
    assert all(b0.units_on(r) == 2 for r in REPLICAS)
    fleet.stalled.discard("b1")  # it resumes thinking it is a home: its loop stood still
    fleet.tick(0.01, 0.002)
    assert all(b1.units_on(r) == 0 for r in REPLICAS)
    b1.set_members(listed, self_listed=False)  # its next heartbeat's answer
    b1.topology_heard()
    settle(fleet)
    assert all(b1.units_on(r) == 0 for r in REPLICAS) and not b1.home_held
    listed.append("b1")  # it registered again: the units are split once more
    for s in fleet.shares:
        s.set_members(listed)
    settle(fleet)
    assert all(b0.units_on(r) >= 1 and b1.units_on(r) >= 1 for r in REPLICAS)


def test_a_draining_balancer_gives_its_units_to_the_others() -> None:
    fleet = Fleet.of(3, 2, seed=13)
    settle(fleet)
    leaving = fleet.shares[2]
    assert leaving.held
    leaving.draining = True
    settle(fleet)
    assert not leaving.held
    assert sum(len(s.held) for s in fleet.shares) == 2 * len(REPLICAS)


def test_a_steady_want_needs_no_message_per_push() -> None:
    """A borrower pushing on a leased unit round after round changes nothing a sibling
    waits for: the grant is renewed with the keepalives, nothing is claimed or answered."""
    fleet = Fleet.of(2, 2, seed=14)
    fleet.queues["b1"] = 10
    fleet.wants["b1"] = {"r0": 2}
    settle(fleet)
    b0, b1 = fleet.shares
    before = (frozenset(b0.grants), frozenset(b1.leases), frozenset(b0.claim_seq), frozenset(b1.claim_seq))
    rng = random.Random(0)
    for _ in range(100):
        fleet.unseen["b1"]["r0"] = rng.randint(0, 2)  # pushes made and seen
        fleet.tick(0.01, 0.002)
    after = (frozenset(b0.grants), frozenset(b1.leases), frozenset(b0.claim_seq), frozenset(b1.claim_seq))
    assert before == after and b1.units_on("r0") == 2


def test_a_sibling_gone_for_a_minute_is_forgotten() -> None:
    """Members that left (terminated instances, new ids) do not pile up in the state."""
    from skymesh.routing.siblings import RegionSiblings, SiblingMessage

    sib = RegionSiblings("r", "b0", 2, dead_after_s=0.3)
    sib.shares.set_replicas(REPLICAS)
    other = PushShares("b9", 2)
    msg = SiblingMessage(region="r", shares=other.message(0, {}, 0.0), sent_at=0.0, pending_prefill_tokens=0,
                         placements_per_s=0.0, loads={}, placements=())
    assert sib.heard(msg, 0.0)
    sib.step(30.0, {}, {})
    assert "b9" in sib.shares.siblings and "b9" in sib.live(0.1)
    sib.step(61.0, {}, {})
    assert "b9" not in sib.shares.siblings and not sib.live(61.0)
    assert sib._heard == {}
