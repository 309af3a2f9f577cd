"""Shared push budgets (skymesh/routing/push_shares.py): however siblings' messages are
delayed, reordered across links or lost, no unit is ever held by two balancers; with
messages flowing every unit of every replica is held; a replica's units are lent to the
sibling whose queue wants it; one balancer alone holds the whole budget."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from skymesh.routing.push_shares import PushShares, ShareState, Unit

REPLICAS = ("r0", "r1", "r2", "r3", "r4")


@dataclass
class Fleet:
    """N balancers exchanging their states over per-link FIFO channels with delays."""

    shares: list[PushShares]
    rng: random.Random
    loss: float = 0.0
    queues: dict[str, int] = field(default_factory=dict)
    wants: dict[str, dict[str, int]] = field(default_factory=dict)
    unseen: dict[str, dict[str, int]] = field(default_factory=dict)
    # (src, dst) -> [(deliver_at, state)], delivered in order
    links: dict[tuple[str, str], list[tuple[float, ShareState]]] = field(default_factory=lambda: defaultdict(list))
    now: float = 0.0

    @classmethod
    def of(cls, n: int, budget: int, seed: int, loss: float = 0.0) -> Fleet:
        shares = [PushShares(f"b{i}", budget, dead_after_s=1e9) for i in range(n)]
        for s in shares:
            s.set_replicas(REPLICAS)
            s.expected = frozenset(o.balancer_id for o in shares if o is not s)
        return cls(shares, random.Random(seed), loss,
                   queues={s.balancer_id: 0 for s in shares},
                   wants={s.balancer_id: {} for s in shares},
                   unseen={s.balancer_id: {} for s in shares})

    def send_all(self, max_delay: float) -> None:
        for s in self.shares:
            msg = s.message(self.queues[s.balancer_id], self.wants[s.balancer_id])
            for o in self.shares:
                if o is s or self.rng.random() < self.loss:
                    continue
                link = self.links[(s.balancer_id, o.balancer_id)]
                at = max([self.now + self.rng.uniform(0, max_delay)] + [t for t, _ in link[-1:]])
                link.append((at, msg))

    def deliver_due(self) -> None:
        by_id = {s.balancer_id: s for s in self.shares}
        for (_, dst), link in self.links.items():
            while link and link[0][0] <= self.now:
                _, msg = link.pop(0)
                by_id[dst].on_message(msg, self.now)

    def step_all(self) -> None:
        for s in self.shares:
            s.step(self.now, self.unseen[s.balancer_id], self.wants[s.balancer_id])

    def use_units(self) -> None:
        """Each balancer pushes within what it holds, and sees some pushes show up."""
        for s in self.shares:
            mine = self.unseen[s.balancer_id]
            for r in REPLICAS:
                n = mine.get(r, 0)
                if n > s.units_on(r) and self.rng.random() < 0.5:
                    n = s.units_on(r)  # a probe shows them (never more than it holds after)
                if self.rng.random() < 0.3 and n < s.units_on(r):
                    n += 1
                elif self.rng.random() < 0.3 and n > 0:
                    n -= 1
                mine[r] = n

    def holders(self) -> dict[Unit, list[str]]:
        out: dict[Unit, list[str]] = defaultdict(list)
        for s in self.shares:
            for u in s.held:
                out[u].append(s.balancer_id)
        return out

    def assert_exclusive(self) -> None:
        for unit, ids in self.holders().items():
            assert len(ids) == 1, f"{unit} held by {ids} at t={self.now:.3f}"

    def tick(self, dt: float, max_delay: float) -> None:
        self.now += dt
        self.deliver_due()
        self.step_all()
        self.assert_exclusive()
        self.send_all(max_delay)


@settings(max_examples=60, deadline=None)
# a sibling heard by some balancers but not yet by another, at the start (found by this test)
@example(n=4, budget=1, seed=0, loss=0.5, max_delay=0.05)
@given(n=st.integers(2, 4), budget=st.integers(1, 3), seed=st.integers(0, 10_000),
       loss=st.sampled_from([0.0, 0.2, 0.5]), max_delay=st.sampled_from([0.001, 0.05, 0.3]))
def test_no_unit_is_ever_held_twice_however_messages_go(n: int, budget: int, seed: int, loss: float,
                                                        max_delay: float) -> None:
    fleet = Fleet.of(n, budget, seed, loss)
    rng = random.Random(seed + 1)
    for _ in range(400):
        if rng.random() < 0.1:  # queues and wants come and go: loans are made and taken back
            who = rng.choice(fleet.shares).balancer_id
            fleet.queues[who] = rng.choice([0, 0, 1, 5, 20])
            fleet.wants[who] = {r: rng.choice([0, 1, 3]) for r in REPLICAS} if fleet.queues[who] else {}
        fleet.use_units()
        fleet.tick(rng.uniform(0.001, 0.05), max_delay)


def settle(fleet: Fleet, rounds: int = 30) -> None:
    for _ in range(rounds):
        fleet.tick(0.01, 0.002)


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


def test_units_of_a_replica_go_to_the_sibling_whose_queue_wants_it() -> None:
    fleet = Fleet.of(2, 2, seed=3)
    settle(fleet)
    b0, b1 = fleet.shares
    assert all(b0.units_on(r) >= 1 and b1.units_on(r) >= 1 for r in REPLICAS)  # one each at least
    fleet.queues["b1"] = 10
    settle(fleet)
    assert all(b1.units_on(r) == 1 for r in REPLICAS)  # a queue alone wants nothing in particular
    fleet.wants["b1"] = {"r0": 4, "r1": 1}
    settle(fleet)
    assert b1.units_on("r0") == 2 and b1.units_on("r1") == 2 and b0.units_on("r0") == 0
    assert all(b0.units_on(r) == 1 for r in REPLICAS[2:])  # what nobody else wants stays home
    # b0 wants r0 itself: its unit comes back; r1 stays lent
    fleet.queues["b0"] = 3
    fleet.wants["b0"] = {"r0": 1}
    settle(fleet)
    assert b0.units_on("r0") == 1 and b1.units_on("r0") == 1 and b1.units_on("r1") == 2
    # b1's queue empties: its loans go back, and b0, still wanting r0, borrows b1's unit
    fleet.queues["b1"], fleet.wants["b1"] = 0, {}
    settle(fleet)
    assert b0.units_on("r0") == 2 and b1.units_on("r0") == 0
    assert all(b0.units_on(r) == 1 and b1.units_on(r) == 1 for r in REPLICAS[1:])
    fleet.assert_exclusive()


def test_a_lent_unit_in_use_is_given_back_only_once_free() -> None:
    fleet = Fleet.of(2, 1, seed=5)
    fleet.queues["b1"] = 10
    fleet.wants["b1"] = dict.fromkeys(REPLICAS, 1)
    settle(fleet)
    lent = [u for u in fleet.shares[1].held if u in fleet.shares[0].lends]
    assert lent, "b0 lent nothing"
    unit = lent[0]
    fleet.unseen["b1"][unit.replica_id] = 1  # b1 pushed with it: the push is unseen yet
    fleet.queues["b0"] = 4  # b0 wants it back
    fleet.wants["b0"] = {unit.replica_id: 1}
    for _ in range(20):
        fleet.now += 0.01
        fleet.deliver_due()
        fleet.step_all()
        fleet.assert_exclusive()
        fleet.send_all(0.002)
    assert unit in fleet.shares[1].held and unit not in fleet.shares[0].held
    fleet.unseen["b1"][unit.replica_id] = 0  # the probe shows it: the unit is free
    settle(fleet)
    assert unit in fleet.shares[0].held


def test_one_balancer_alone_holds_the_whole_budget_after_its_grace() -> None:
    s = PushShares("b0", 2, dead_after_s=0.3)
    s.set_replicas(REPLICAS)
    s.step(0.1, {}, {})
    assert s.units_on("r0") == 0  # a sibling may be up and holding: wait to hear it
    s.step(0.31, {}, {})
    assert all(s.units_on(r) == 2 for r in REPLICAS)


def test_a_silent_sibling_is_dead_and_its_units_are_taken() -> None:
    fleet = Fleet.of(2, 2, seed=11)
    for s in fleet.shares:
        s.dead_after_s = 0.1
    settle(fleet)
    b0, b1 = fleet.shares
    assert any(b1.units_on(r) for r in REPLICAS)
    for _ in range(30):  # b1 is gone: b0 hears nothing more
        fleet.now += 0.01
        b0.step(fleet.now, {}, {})
        b0.message(0, {})
    assert all(b0.units_on(r) == 2 for r in REPLICAS)


def test_a_draining_balancer_gives_its_units_to_the_others() -> None:
    fleet = Fleet.of(3, 2, seed=13)
    settle(fleet)
    leaving = fleet.shares[2]
    assert leaving.held
    leaving.draining = True
    settle(fleet)
    assert not leaving.held
    assert sum(len(s.held) for s in fleet.shares) == 2 * len(REPLICAS)


def test_a_sibling_gone_for_a_minute_is_forgotten() -> None:
    """Members that left (terminated instances, new ids) do not pile up in the state."""
    from skymesh.routing.siblings import RegionSiblings, SiblingMessage

    sib = RegionSiblings("r", "b0", 2, dead_after_s=0.3)
    sib.shares.set_replicas(REPLICAS)
    other = PushShares("b9", 2)
    msg = SiblingMessage(region="r", shares=other.message(0, {}), sent_at=0.0, pending_prefill_tokens=0,
                         placements_per_s=0.0, loads={}, placements=())
    assert sib.heard(msg, 0.0)
    sib.step(30.0, {}, {})
    assert "b9" in sib.shares.siblings and "b9" in sib.live(0.1)
    sib.step(61.0, {}, {})
    assert "b9" not in sib.shares.siblings and not sib.live(61.0)
    assert sib._heard == {}
