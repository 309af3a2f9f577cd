"""Shared push budgets by leases: the balancers of one region together never have more
unseen pushes on a replica than the dispatch budget one balancer would (docs/routing.md,
"A region is a fleet"), pure.

A replica's ``dispatch_budget`` is cut into that many *units* (replica, index). A balancer
may have as many of its pushes unseen on a replica as it has units there
(:meth:`PushShares.units_on`). The invariant: no unit is usable by two balancers at once,
under message loss and delay, a member's death, a stalled loop and bounded clock skew.

- **Homes from the agreed member list.** Every unit has one home: the region's members as
  the controller's topology (or, without one, the config) lists them, sorted by id, less
  those that said they are draining; unit i of replica r goes to
  ``(stable_hash(r) + i) mod n``. A silent member keeps its home units (nobody takes them
  on a timeout) until the topology drops it; the region serves on the other units
  meanwhile.
- **Taking a home unit** (at start, or when the member list changed) is the only step
  that waits for answers: the new home *claims* it and takes it once every sibling it
  hears has seen the claim and neither holds it nor claims it from a lower id. A sibling
  silent for a whole lease and the skew margin holds nothing it could still use: it is
  not waited for. After that, a home keeps its units with no message at all.
- **Leases, not consensus.** A home lends units it is not using to the siblings that want
  that replica (their picks went elsewhere for lack of a unit there), all grants of a
  round in one message, each valid for ``lease_s`` from the moment the message was built.
  A sibling that holds a home unit of the replica itself borrows only a unit left unused
  here for ``want_memory_s`` (a keepalive), so members under like demand do not trade one
  unit back and forth at every gap between pushes.
  A borrower uses a leased unit until it releases it or the lease ends (on its own clock:
  a borrower whose loop stalled finds the lease over when it resumes), with no
  acknowledgement per use. The home renews a grant in every message while the borrower
  still holds or wants it and the home does not want it back; a grant missing from the
  home's latest message is recalled, and the borrower releases it once unused. The home
  uses the unit again only once a message of the borrower that has seen its last grant no
  longer holds it, or ``lease_s`` plus ``skew_margin_s`` after its last grant.
- **A stalled member fences itself.** Steps come at least every keepalive in the daemon;
  a gap longer than ``stall_fence_s`` means this balancer's loop stood still, during
  which the topology may have given its home units to others. Until it hears the topology
  again (:meth:`PushShares.topology_heard`) or a whole takeover time passed, it uses no
  home unit, only its leases (which its own clock ends).

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
    # replica -> queued requests its policy picked it for, with no free unit here
    wants: Mapping[str, int]
    # units it holds: its home units (lent or not) and its leases
    held: frozenset[Unit]
    # home units it takes (answer: hold none of them, claim none from a lower id)
    claims: frozenset[Unit]
    # home units lent in this message: unit -> (borrower, lease seconds from sent_at)
    grants: Mapping[Unit, tuple[str, float]] = field(default_factory=dict)
    # per sibling id: the (epoch, seq) of its last message processed here
    seen: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    draining: bool = False
    # when it was built, on the receiver's clock (the daemon rebases it by the wall clocks)
    sent_at: float = 0.0


@dataclass(slots=True)
class _Sibling:
    state: ShareState
    heard_at: float


@dataclass(slots=True)
class _Grant:
    """A home unit lent out, as its home sees it."""

    borrower: str
    expires_at: float  # the home's clock, skew margin included
    last_seq: int  # the last message that carried it
    renew: bool = True


@dataclass(slots=True)
class _Lease:
    """A unit borrowed, as the borrower sees it."""

    home: str
    expires_at: float  # the borrower's clock
    recalled: bool = False
    last_used_at: float = 0.0


@functools.lru_cache(maxsize=4096)
def _replica_offset(replica_id: str) -> int:
    # stable across processes and runs (Python's str hash is salted per process)
    return zlib.crc32(replica_id.encode())


@dataclass(slots=True)
class PushShares:
    balancer_id: str
    budget: int
    epoch: int = 1
    # a sibling silent this long counts as gone for the figures it reported (loads, queue)
    dead_after_s: float = 0.3
    lease_s: float = 1.0
    skew_margin_s: float = 0.25
    stall_fence_s: float = 1.0
    draining: bool = False
    seq: int = 0
    replicas: tuple[str, ...] = ()
    # home units taken (lent or not)
    home_held: set[Unit] = field(default_factory=set)
    # unit -> the seq of the first message that carried this claim
    claim_seq: dict[Unit, int] = field(default_factory=dict)
    grants: dict[Unit, _Grant] = field(default_factory=dict)
    leases: dict[Unit, _Lease] = field(default_factory=dict)
    # a lease released: the first of our messages without it; a grant of it counts again
    # only from a home message that has seen that one
    released: dict[Unit, int] = field(default_factory=dict)
    siblings: dict[str, _Sibling] = field(default_factory=dict)
    started_at: float = 0.0
    # the other members this balancer knows of (the topology's, else the config's)
    expected: frozenset[str] = frozenset()
    self_listed: bool = True
    _held_on: dict[str, int] = field(default_factory=dict)
    # this balancer's unseen pushes per replica, as of the last step
    _unseen: Mapping[str, int] = field(default_factory=dict)
    _last_step_at: float | None = None
    _homes_now: list[str] = field(default_factory=list)
    # since when this balancer's loop has run without a stall: a sibling's silence counts
    # from here
    _awake_since: float = 0.0
    # replica -> (when this balancer last wanted it, how many requests then): a want is
    # remembered for want_memory_s, so grants, recalls and the messages they take follow
    # the demand of a while, not every dispatch round's
    want_memory_s: float = 0.25
    _wanted: dict[str, tuple[float, int]] = field(default_factory=dict)
    _fenced_at: float | None = None
    # replica -> the last step at which this balancer had a push unseen there (a sibling
    # with a home unit of its own there borrows only a unit left unused for want_memory_s)
    _in_use_at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError("a push budget needs at least one unit")

    # ------------------------------------------------------------------ queries

    def units_on(self, replica_id: str) -> int:
        """How many of its pushes this balancer may have unseen on ``replica_id``."""
        return self._held_on.get(replica_id, 0)

    def usable_counts(self) -> Mapping[str, int]:
        """Per replica, :meth:`units_on` (as of the last step or expiry)."""
        return self._held_on

    @property
    def held(self) -> frozenset[Unit]:
        """The units this balancer may push on or still has pushes unseen on."""
        own = {u for u in self.home_held if u not in self.grants}
        return frozenset(own | self.leases.keys())

    @property
    def takeover_s(self) -> float:
        """How long a sibling is silent before it can hold nothing it could still use."""
        return self.lease_s + self.skew_margin_s

    def _homes(self) -> list[str]:
        members = sorted({*self.expected, self.balancer_id} if self.self_listed else self.expected)
        homes = [sid for sid in members if not self._is_draining(sid)]
        return homes or members or [self.balancer_id]  # all leaving: they keep what they hold

    @staticmethod
    def _home(unit: Unit, homes: list[str]) -> str:
        return homes[(_replica_offset(unit.replica_id) + unit.index) % len(homes)]

    # ------------------------------------------------------------------ events in

    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        self.replicas = tuple(dict.fromkeys(replica_ids))
        keep = set(self.replicas)
        self.home_held = {u for u in self.home_held if u.replica_id in keep}
        self.claim_seq = {u: s for u, s in self.claim_seq.items() if u.replica_id in keep}
        self.grants = {u: g for u, g in self.grants.items() if u.replica_id in keep}
        self.leases = {u: ls for u, ls in self.leases.items() if u.replica_id in keep}
        self.released = {u: r for u, r in self.released.items() if u.replica_id in keep}
        self._in_use_at = {r: at for r, at in self._in_use_at.items() if r in keep}
        self._count_held()

    def set_members(self, sibling_ids: Iterable[str], *, self_listed: bool = True) -> None:
        """The other members of the region (the topology's live ones, else the config's);
        ``self_listed`` False: the topology calls this balancer dead (it was stalled or cut
        off): it is nobody's home until listed again."""
        self.expected = frozenset(sid for sid in sibling_ids if sid != self.balancer_id)
        self.self_listed = self_listed

    def topology_heard(self) -> None:
        """The controller's topology arrived: a fence after a stall ends (what it says of
        the members came with it)."""
        if self._fenced_at is not None:
            self._fenced_at = None
            self._awake_since = max(self._awake_since, self._last_step_at or 0.0)

    def on_message(self, state: ShareState, now: float) -> bool:
        """A sibling's state; False when it is older than one already processed."""
        if state.balancer_id == self.balancer_id:
            return False
        prev = self.siblings.get(state.balancer_id)
        if prev is not None and (state.epoch, state.seq) <= (prev.state.epoch, prev.state.seq):
            return False
        self.siblings[state.balancer_id] = _Sibling(state, now)
        self._take_grants(state, now)
        return True

    def forget_dead(self, now: float, keep_for_s: float = 60.0) -> None:
        """Drop siblings silent for ``keep_for_s`` (they count as dead well before)."""
        for sid in [sid for sid, s in self.siblings.items() if now - s.heard_at > keep_for_s]:
            del self.siblings[sid]

    # ------------------------------------------------------------------ one step

    def step(self, now: float, unseen_pushes: Mapping[str, int], wants: Mapping[str, int]) -> None:
        """Expire, release and take back leases, give up and take home units, from the
        latest message of every sibling. ``unseen_pushes``: per replica, this balancer's
        pushes its last probe does not show yet (the units it uses); ``wants``: per
        replica, its queued requests that found no free unit there."""
        if self._last_step_at is not None and now - self._last_step_at > self.stall_fence_s:
            # this loop stood still: the topology may have given its home units away and
            # its siblings' silence meant nothing. It holds no home unit, and claims them
            # again once it heard the topology, waiting for every sibling as at a start
            self._fenced_at = now
            self.home_held.clear()
            self.claim_seq.clear()
            self._awake_since = now
        if self._fenced_at is not None and now - self._fenced_at > self.takeover_s + self.stall_fence_s:
            self._fenced_at = None
        self._last_step_at = now
        self._unseen = unseen_pushes
        for r, n in unseen_pushes.items():
            if n > 0:
                self._in_use_at[r] = now
        wants = self._remember_wants(wants, now)
        homes = self._homes()
        self._homes_now = homes
        self._end_grants(now, wants)
        self._end_leases(now, unseen_pushes, wants)
        self._give_up_homes(homes, unseen_pushes)
        self._claim_homes(homes, now)
        self._count_held()

    def expire(self, now: float) -> None:
        """Drop leases past their end (before a dispatch round: a loop that stood still
        since the last step must not push on a lease that ended meanwhile)."""
        if any(ls.expires_at <= now for ls in self.leases.values()):
            for u in [u for u, ls in self.leases.items() if ls.expires_at <= now]:
                del self.leases[u]
            self._count_held()

    def message(self, queue_length: int, wants: Mapping[str, int], now: float = 0.0) -> ShareState:
        """This balancer's state for its siblings (the next sequence number). Lends the
        units it does not use to the siblings that want their replica, and renews the
        grants it keeps: each valid for ``lease_s`` from ``now``."""
        self.seq += 1
        wants = self._remember_wants(wants, now)
        self._lend(wants, now)
        granted = {}
        for u, g in self.grants.items():
            if g.renew:
                g.expires_at = now + self.lease_s + self.skew_margin_s
                g.last_seq = self.seq
                granted[u] = (g.borrower, self.lease_s)
        self._count_held()
        return ShareState(
            balancer_id=self.balancer_id, epoch=self.epoch, seq=self.seq, queue_length=queue_length,
            wants={r: n for r, n in wants.items() if n > 0},
            held=frozenset(self.home_held | self.leases.keys()), claims=frozenset(self.claim_seq), grants=granted,
            seen={sid: (s.state.epoch, s.state.seq) for sid, s in self.siblings.items()},
            draining=self.draining, sent_at=now,
        )

    # ------------------------------------------------------------------ parts

    def _remember_wants(self, wants: Mapping[str, int], now: float) -> dict[str, int]:
        """The replicas wanted within ``want_memory_s`` (the latest count of each)."""
        for r, n in wants.items():
            if n > 0:
                self._wanted[r] = (now, n)
        for r in [r for r, (at, _) in self._wanted.items() if now - at > self.want_memory_s]:
            del self._wanted[r]
        return {r: n for r, (_, n) in self._wanted.items()}

    def _is_draining(self, balancer_id: str) -> bool:
        if balancer_id == self.balancer_id:
            return self.draining
        s = self.siblings.get(balancer_id)
        return s is not None and s.state.draining

    def _heard_recently(self, sid: str, now: float) -> bool:
        s = self.siblings.get(sid)
        return s is not None and now - s.heard_at <= self.dead_after_s

    def _take_grants(self, state: ShareState, now: float) -> None:
        home = state.balancer_id
        for u, (borrower, ttl) in state.grants.items():
            if borrower != self.balancer_id:
                continue
            rel = self.released.get(u)
            if rel is not None:
                if state.seen.get(self.balancer_id, (0, 0)) < (self.epoch, rel):
                    continue  # made before the home saw our release of it
                del self.released[u]
            expires_at = state.sent_at + min(ttl, self.lease_s)
            if expires_at <= now:
                continue
            lease = self.leases.get(u)
            if lease is None or lease.home != home:
                self.leases[u] = _Lease(home, expires_at, last_used_at=now)
            else:
                lease.expires_at = max(lease.expires_at, expires_at)
                lease.recalled = False
        for u, lease in self.leases.items():
            if lease.home == home and u not in state.grants:
                lease.recalled = True

    def _end_grants(self, now: float, wants: Mapping[str, int]) -> None:
        """A grant ends when the borrower showed it released it (having seen the last
        grant) or its lease ran out; it is not renewed once this balancer wants the
        replica, or the borrower neither holds it nor wants its replica, or is silent."""
        for u, g in list(self.grants.items()):
            if g.expires_at <= now:
                del self.grants[u]
                continue
            st = self.siblings.get(g.borrower)
            if st is not None and st.state.seen.get(self.balancer_id, (0, 0)) >= (self.epoch, g.last_seq) \
                    and u not in st.state.held:
                del self.grants[u]
                continue
            r = u.replica_id
            mine = wants.get(r, 0) > 0 and not self.draining
            borrower_needs = st is not None and (u in st.state.held or st.state.wants.get(r, 0) > 0)
            if mine or not borrower_needs or not self._heard_recently(g.borrower, now) \
                    or u not in self.home_held:
                g.renew = False

    def _end_leases(self, now: float, unseen_pushes: Mapping[str, int], wants: Mapping[str, int]) -> None:
        """Leases past their end go; a lease recalled by its home, or unused for a whole
        lease with its replica wanted no more, is released once its pushes were seen."""
        for u in [u for u, ls in self.leases.items() if ls.expires_at <= now]:
            del self.leases[u]
        for r in {u.replica_id for u in self.leases}:
            mine = sorted((u for u in self.leases if u.replica_id == r), reverse=True)
            in_use = unseen_pushes.get(r, 0)
            usable = self._usable_home_on(r) + len(mine)
            if in_use > 0:
                for u in mine:
                    self.leases[u].last_used_at = now
            for u in mine:
                lease = self.leases[u]
                idle = now - lease.last_used_at >= self.lease_s and wants.get(r, 0) == 0
                if (lease.recalled or idle) and in_use <= usable - 1:
                    self.released[u] = self.seq + 1
                    del self.leases[u]
                    usable -= 1

    def _usable_home_on(self, replica_id: str) -> int:
        if self._fenced_at is not None:
            return 0
        return sum(1 for u in self.home_held if u.replica_id == replica_id and u not in self.grants)

    def _give_up_homes(self, homes: list[str], unseen_pushes: Mapping[str, int]) -> None:
        """Home units whose home is no longer here go once unused (and are lent no more)."""
        for r in {u.replica_id for u in self.home_held if self._home(u, homes) != self.balancer_id}:
            mine = [u for u in self.home_held if u.replica_id == r]
            spare = self._usable_home_on(r) + sum(1 for u in self.leases if u.replica_id == r) \
                - unseen_pushes.get(r, 0)
            for u in sorted((u for u in mine if self._home(u, homes) != self.balancer_id), reverse=True):
                if u in self.grants:
                    self.grants[u].renew = False
                    continue  # its borrower gives it back (or the lease ends) first
                if spare <= 0:
                    break
                self.home_held.discard(u)
                spare -= 1

    def _claim_homes(self, homes: list[str], now: float) -> None:
        for u in list(self.claim_seq):
            if self._home(u, homes) != self.balancer_id or u in self.home_held:
                del self.claim_seq[u]
        next_seq = self.seq + 1
        for r in self.replicas:
            for i in range(self.budget):
                u = Unit(r, i)
                if u not in self.home_held and u not in self.claim_seq and self._home(u, homes) == self.balancer_id:
                    self.claim_seq[u] = next_seq
        if not self.claim_seq or self._fenced_at is not None:
            return
        waiting_for_start = now - max(self.started_at, self._awake_since) < self.takeover_s
        for u, claimed_at in list(self.claim_seq.items()):
            if u in self.leases:
                continue  # borrowed from its old home: it becomes ours once given back
            if self._confirmed(u, claimed_at, now, waiting_for_start):
                self.home_held.add(u)
                del self.claim_seq[u]

    def _confirmed(self, unit: Unit, claimed_at: int, now: float, waiting_for_start: bool) -> bool:
        """Every sibling that may hold ``unit`` said it does not, having seen our claim. A
        sibling silent for ``takeover_s`` holds nothing it could still use (its leases
        ended on its own clock; a home unit it took on a view older than ours it stops
        using once it finds its loop stood still); one expected and never heard is waited
        for ``takeover_s`` after this balancer started."""
        sent = claimed_at <= self.seq
        for sid in self.expected | self.siblings.keys():
            heard = self.siblings.get(sid)
            if heard is None:
                if waiting_for_start:
                    return False
                continue
            if now - max(heard.heard_at, self._awake_since) > self.takeover_s:
                continue
            st = heard.state
            if not sent or st.seen.get(self.balancer_id, (0, 0)) < (self.epoch, claimed_at):
                return False
            if unit in st.held or unit in st.grants or (unit in st.claims and sid < self.balancer_id):
                return False
        return True

    def _lend(self, wants: Mapping[str, int], now: float) -> None:
        """Lend what this balancer does not use of its home units to the siblings that want
        their replica, the one wanting it most first. A sibling that holds a home unit of
        that replica itself borrows only once this balancer has had no push unseen there
        for ``want_memory_s``: members that share a replica's units under like demand
        would otherwise lend each other the unit in every gap between pushes, a grant and
        a recall (two messages) each time, for no request placed sooner on the whole; a
        sibling with no unit of its own there gets one at once (it has no other way in)."""
        if self._fenced_at is not None:
            return
        takers: dict[str, list[tuple[int, str]]] = {}
        for sid, s in self.siblings.items():
            if not self._heard_recently(sid, now):
                continue  # a draining sibling still borrows: it serves what its kept-alive connections bring
            for r, n in s.state.wants.items():
                if n > 0 and (self._lacks_home_unit(s.state, sid, r)
                              or now - self._in_use_at.get(r, float("-inf")) >= self.want_memory_s):
                    takers.setdefault(r, []).append((-n, sid))
        if not takers:
            return
        for r, who in takers.items():
            if wants.get(r, 0) > 0 and not self.draining:
                continue
            free = sorted(u for u in self.home_held if u.replica_id == r and u not in self.grants)
            if not free:
                continue
            who.sort()
            # lend only what is not in use here (the highest indexes first)
            leased = sum(1 for u in self.leases if u.replica_id == r)
            spare = min(len(free), len(free) + leased - self._unseen.get(r, 0))
            counts = {sid: -n for n, sid in who}
            for u in reversed(free):
                if spare <= 0 or not who:
                    break
                _, sid = who[0]
                if u in self.claim_seq:
                    continue
                self.grants[u] = _Grant(sid, now + self.lease_s + self.skew_margin_s, self.seq)
                spare -= 1
                counts[sid] -= 1
                if counts[sid] <= 0:
                    who.pop(0)

    def _lacks_home_unit(self, state: ShareState, sid: str, replica_id: str) -> bool:
        """The sibling ``sid`` holds no home unit of ``replica_id`` (as it last said)."""
        homes = self._homes_now or self._homes()
        return not any(u.replica_id == replica_id and self._home(u, homes) == sid for u in state.held)

    def units_in_use(self) -> frozenset[Unit]:
        """The units this balancer may push on, or may still have pushes unseen on (what
        no other balancer may hold meanwhile)."""
        return frozenset(self.leases) if self._fenced_at is not None else self.held

    def _count_held(self) -> None:
        """Per replica, the units new pushes may use: home units still homed here, not lent,
        not fenced, and leases not recalled (units on their way out carry only the pushes
        already made on them)."""
        counts: dict[str, int] = {}
        fenced = self._fenced_at is not None
        homes = self._homes_now
        for u in self.home_held:
            if not fenced and u not in self.grants and (not homes or self._home(u, homes) == self.balancer_id):
                counts[u.replica_id] = counts.get(u.replica_id, 0) + 1
        for u, ls in self.leases.items():
            if not ls.recalled:
                counts[u.replica_id] = counts.get(u.replica_id, 0) + 1
        self._held_on = counts
