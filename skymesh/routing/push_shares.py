"""Shared push budgets: the balancers of one region together never push a replica past
the dispatch budget one balancer would (docs/routing.md, "A region is a fleet"), pure.

A replica's ``dispatch_budget`` is cut into that many *units* (replica, index). A balancer
may have as many of its pushes unseen on a replica as it holds units there
(:class:`~skymesh.routing.dispatcher.BalancerCore` asks :meth:`PushShares.units_on`). The
protocol keeps one invariant: no unit is held by two live balancers at once, so the
region's unseen pushes on a replica stay within one budget however many balancers there
are.

- **Homes.** Each unit has a home among the live, non-draining balancers: they are
  sorted by id and unit i of replica r goes to ``(stable_hash(r) + i) mod n``, so two
  balancers hold one unit of every replica each and three share every replica's two units
  two by two, rotated by replica.
- **Lending** (a freed replica is filled by any sibling's queue). Each balancer says
  which replicas its queue *wants*: its policy picked them for a queued request (seeing
  the replica free region-wide) but it holds no free unit there. A home not wanting a
  replica itself lends each unit of it it is not using to the sibling that wants it most;
  it takes the loan back when it wants the replica itself, when the borrower has nothing
  queued any more, or when another sibling wants it and the borrower does not.
- **Claim, confirm, hold.** A balancer entitled to a unit (its home and not lending it,
  or its home's latest message lends it there) *claims* it in its next message and holds
  it only once every other live sibling answered with a message that (a) has seen the
  claim (its ``seen`` sequence for the claimant is at or past the claim's) and (b) neither
  holds the unit nor claims it from a lower id. A holder no longer entitled gives the
  unit up once it is unused (its unseen pushes there fit in the units it keeps). Every
  message is the sender's whole state, so the rule needs no ordering beyond one stream's
  (gRPC streams are ordered) and survives any lost message: the next one repeats it.
- **Start.** For ``dead_after_s`` after it starts, a balancer counts every sibling it
  expects (config, controller) as live even unheard: a claim holds only once each has
  answered (a sibling heard by some but not yet by this one may hold units).
- **Death.** A sibling not heard from for ``dead_after_s`` leaves the live set: the
  units it held are claimed again without its answer. Its pushes in transit may then
  overlap a new holder's for one probe interval (the replica's page shows them at the
  next probe): the cost of a sibling dying, never of a message lost.

One balancer alone holds every unit of every replica at once: the protocol changes
nothing for a region of one.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, order=True)
class Unit:
    replica_id: str
    index: int


@dataclass(frozen=True, slots=True)
class ShareState:
    """What one balancer tells its siblings of the push budget (its whole state)."""

    balancer_id: str
    epoch: int
    seq: int
    queue_length: int
    # replica -> queued requests here its policy picked it for, with no free unit here
    wants: Mapping[str, int]
    held: frozenset[Unit]
    claims: frozenset[Unit]
    lends: Mapping[Unit, str]
    # per sibling id: the (epoch, seq) of its last message processed here
    seen: Mapping[str, tuple[int, int]]
    draining: bool = False


@dataclass(slots=True)
class _Sibling:
    state: ShareState
    heard_at: float


@functools.lru_cache(maxsize=4096)
def _replica_offset(replica_id: str) -> int:
    # stable across processes and runs (Python's str hash is salted per process)
    return zlib.crc32(replica_id.encode())


@dataclass(slots=True)
class PushShares:
    balancer_id: str
    budget: int
    epoch: int = 1
    dead_after_s: float = 0.3
    draining: bool = False
    seq: int = 0
    replicas: tuple[str, ...] = ()
    held: set[Unit] = field(default_factory=set)
    # unit -> the seq of the first message that carried this claim
    claim_seq: dict[Unit, int] = field(default_factory=dict)
    lends: dict[Unit, str] = field(default_factory=dict)
    siblings: dict[str, _Sibling] = field(default_factory=dict)
    # when this balancer started: until dead_after_s later it holds nothing without
    # hearing its siblings (one may be up and holding units it has not heard of yet)
    started_at: float = 0.0
    # the siblings this balancer knows of (config, controller), heard from or not
    expected: frozenset[str] = frozenset()
    _held_on: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError("a push budget needs at least one unit")

    # ------------------------------------------------------------------ queries

    def units_on(self, replica_id: str) -> int:
        """How many of its pushes this balancer may have unseen on ``replica_id``."""
        return self._held_on.get(replica_id, 0)

    def live_ids(self, now: float) -> list[str]:
        """This balancer and every sibling heard from within ``dead_after_s``, by id; until
        ``dead_after_s`` after this balancer started, also every expected sibling not
        heard yet (it may be up and holding units: it must answer before a claim holds)."""
        ids = {self.balancer_id}
        ids.update(sid for sid, s in self.siblings.items() if now - s.heard_at <= self.dead_after_s)
        if now - self.started_at <= self.dead_after_s:
            ids.update(self.expected)
        return sorted(ids)

    def _homes(self, now: float) -> list[str]:
        """The balancers units have homes at: the live ones not draining, by id."""
        live = self.live_ids(now)
        homes = [sid for sid in live if not self._is_draining(sid)]
        return homes or live  # every live balancer is leaving: they keep what they hold

    @staticmethod
    def _home(unit: Unit, homes: list[str]) -> str:
        return homes[(_replica_offset(unit.replica_id) + unit.index) % len(homes)]

    # ------------------------------------------------------------------ events in

    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        self.replicas = tuple(dict.fromkeys(replica_ids))
        keep = set(self.replicas)
        self.held = {u for u in self.held if u.replica_id in keep}
        self.claim_seq = {u: s for u, s in self.claim_seq.items() if u.replica_id in keep}
        self.lends = {u: b for u, b in self.lends.items() if u.replica_id in keep}
        self._count_held()

    def on_message(self, state: ShareState, now: float) -> bool:
        """A sibling's state; False when it is older than one already processed."""
        if state.balancer_id == self.balancer_id:
            return False
        prev = self.siblings.get(state.balancer_id)
        if prev is not None and (state.epoch, state.seq) <= (prev.state.epoch, prev.state.seq):
            return False
        self.siblings[state.balancer_id] = _Sibling(state, now)
        return True

    def forget_dead(self, now: float, keep_for_s: float = 60.0) -> None:
        """Drop siblings silent for ``keep_for_s`` (they count as dead well before)."""
        for sid in [sid for sid, s in self.siblings.items() if now - s.heard_at > keep_for_s]:
            del self.siblings[sid]

    # ------------------------------------------------------------------ one step

    def step(self, now: float, unseen_pushes: Mapping[str, int], wants: Mapping[str, int]) -> None:
        """Lend, take loans back, give up, claim and take units, from the latest message
        of every sibling. ``unseen_pushes``: per replica, this balancer's pushes its last
        probe does not show yet (the units it uses); ``wants``: per replica, its queued
        requests waiting for a unit there."""
        live = set(self.live_ids(now))
        homes = self._homes(now)
        self._lend(homes, unseen_pushes, wants, live)
        entitled = {u for r in self.replicas for u in self._units_of(r) if self._entitled(u, homes)}
        self._give_up(entitled, unseen_pushes)
        for u in list(self.claim_seq):
            if u not in entitled or u in self.held:
                del self.claim_seq[u]
        next_seq = self.seq + 1
        for u in entitled:
            if u not in self.held and u not in self.claim_seq:
                self.claim_seq[u] = next_seq
        alone = live == {self.balancer_id}
        if alone and now - self.started_at < self.dead_after_s:
            self._count_held()
            return
        for u, claimed_at in list(self.claim_seq.items()):
            # alone (every sibling silent past dead_after_s): nobody to confirm
            if alone or (claimed_at <= self.seq and self._confirmed(u, claimed_at, live)):
                self.held.add(u)
                del self.claim_seq[u]
        self._count_held()

    def message(self, queue_length: int, wants: Mapping[str, int]) -> ShareState:
        """This balancer's state for its siblings (the next sequence number)."""
        self.seq += 1
        return ShareState(
            balancer_id=self.balancer_id, epoch=self.epoch, seq=self.seq, queue_length=queue_length,
            wants={r: n for r, n in wants.items() if n > 0},
            held=frozenset(self.held), claims=frozenset(self.claim_seq), lends=dict(self.lends),
            seen={sid: (s.state.epoch, s.state.seq) for sid, s in self.siblings.items()},
            draining=self.draining,
        )

    # ------------------------------------------------------------------ parts

    def _units_of(self, replica_id: str) -> list[Unit]:
        return [Unit(replica_id, i) for i in range(self.budget)]

    def _is_draining(self, balancer_id: str) -> bool:
        if balancer_id == self.balancer_id:
            return self.draining
        s = self.siblings.get(balancer_id)
        return s is not None and s.state.draining

    def _entitled(self, unit: Unit, homes: list[str]) -> bool:
        home = self._home(unit, homes)
        if home == self.balancer_id:
            return unit not in self.lends
        s = self.siblings.get(home)
        return s is not None and s.state.lends.get(unit) == self.balancer_id

    def _lend(self, homes: list[str], unseen_pushes: Mapping[str, int], wants: Mapping[str, int],
              live: set[str]) -> None:
        others = {sid: s.state for sid, s in self.siblings.items() if sid in live}

        def wanting(r: str) -> list[str]:
            return sorted((sid for sid, st in others.items() if st.wants.get(r, 0) > 0),
                          key=lambda sid: (-others[sid].wants[r], sid))

        # take back: wanted here, a borrower gone or with nothing queued, or another
        # sibling wants the replica and the borrower does not
        for u, borrower in list(self.lends.items()):
            r = u.replica_id
            st = others.get(borrower)
            mine = wants.get(r, 0) > 0 and not self.draining
            if mine or st is None or st.queue_length == 0 or (st.wants.get(r, 0) == 0 and wanting(r)):
                del self.lends[u]
        for r in self.replicas:
            if wants.get(r, 0) > 0 and not self.draining:
                continue
            takers = wanting(r)
            if not takers:
                continue
            lent_here = sum(1 for u in self.lends if u.replica_id == r)
            spare = self._held_on.get(r, 0) - unseen_pushes.get(r, 0) - lent_here
            for u in sorted((u for u in self.held if u.replica_id == r), reverse=True):
                if spare <= 0:
                    break
                if u not in self.lends and self._home(u, homes) == self.balancer_id:
                    self.lends[u] = takers[0]
                    spare -= 1

    def _give_up(self, entitled: set[Unit], unseen_pushes: Mapping[str, int]) -> None:
        for r in {u.replica_id for u in self.held if u not in entitled}:
            mine = [u for u in self.held if u.replica_id == r]
            spare = len(mine) - unseen_pushes.get(r, 0)
            for u in sorted(u for u in mine if u not in entitled):
                if spare <= 0:
                    break
                self.held.discard(u)
                spare -= 1

    def _confirmed(self, unit: Unit, claimed_at: int, live: set[str]) -> bool:
        for sid in live:
            if sid == self.balancer_id:
                continue
            heard = self.siblings.get(sid)
            if heard is None:  # expected, not heard yet: no word from it
                return False
            st = heard.state
            if st.seen.get(self.balancer_id, (0, 0)) < (self.epoch, claimed_at):
                return False
            if unit in st.held or (unit in st.claims and sid < self.balancer_id):
                return False
        return True

    def _count_held(self) -> None:
        counts: dict[str, int] = {}
        for u in self.held:
            counts[u.replica_id] = counts.get(u.replica_id, 0) + 1
        self._held_on = counts
