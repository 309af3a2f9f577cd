"""Each replica's push budget (SkyWalker's selective pushing), as one balancer keeps it, pure.

A replica is *available* only while its last probe reported no waiting request
(``vllm:num_requests_waiting == 0``) and the balancer has not already pushed
``dispatch_budget`` requests to it since that probe (so it never overfills between
probes). Requests it pushed that a probe's page does not show yet stay *charged* to the
budget: resetting the charge to 0 with every page would let the balancer push a second
budget on top of requests still in transit to the replica's scheduler (or of a page older
than them: vLLM moves its gauges once per engine step). A first token coming back proves
the replica admitted that request, so it returns one unit of budget early, unless the
page already showed it (its credit took it off the budget then).

Which pushes a page shows is the *credit rule*'s call:

- :class:`CountCredit`, a region of one balancer: the page's running + waiting count, less
  this balancer's requests that already have a first token, shows that many of its
  unstarted pushes (the oldest: the replica admits in arrival order).
- :class:`TimeCredit`, a region of several balancers (``siblings``,
  skymesh/routing/push_shares.py): the page counts the siblings' requests too, so its
  count cannot tell whose pushes it shows; time can. A push reaches the replica's page
  within ``siblings.page_lag_s``, so a page scraped later shows it. This balancer may push
  to a replica only within the units it holds there (its home's, or leased from their
  home); a replica is still available when it is free region-wide (its budget less every
  balancer's unseen pushes there, as they last said), and a pick of one where this
  balancer holds no free unit waits for a lease (a *want*, which the unit's home answers
  in its next message). A replica's ``pending_prefill_tokens`` in the views the policy
  sees is the region's: this balancer's own plus what its siblings last said they have
  there without a first token.

:meth:`PushBudget.attach_siblings` swaps the first rule for the second; the dispatcher
(skymesh/routing/dispatcher.py) asks the budget and never which rule it has.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Protocol

from skymesh.routing.siblings import RegionSiblings


class CreditRule(Protocol):
    """How a page of a replica credits this balancer's pushes there, and what of the
    replica's budget this balancer may use."""

    @property
    def shared(self) -> bool:
        """The budget is shared with sibling balancers."""
        ...

    def units_on(self, replica_id: str, dispatch_budget: int) -> int:
        """Pushes this balancer may have unseen on the replica."""
        ...

    def unseen_elsewhere(self, replica_id: str) -> int:
        """The other balancers' pushes to the replica their last page did not show yet."""
        ...

    def page_shows_until(self, sent_at: float | None) -> float | None:
        """The push time up to which a healthy page scraped at ``sent_at`` shows pushes
        (None: the rule goes by no time, or the scrape's time is not known)."""
        ...

    def charged_after_page(self, pushed_at: Sequence[float], shows_until: float | None, *, in_flight: int,
                           num_running: int, num_waiting: int) -> int:
        """Of the unstarted pushes (``pushed_at``, in push order), how many a healthy page
        does not show yet; ``in_flight``: this balancer's requests on the replica."""
        ...

    def shown_by_page(self, pushed_at: float, shows_until: float | None, *, charged: int, unstarted: int) -> bool:
        """The last page showed the push made at ``pushed_at`` (its credit took its unit
        then); ``charged`` and ``unstarted`` as they were before it leaves."""
        ...

    def awaits_lease(self, free_here: bool) -> bool:
        """A pick of an available replica waits for a unit leased from its home."""
        ...

    def expire(self, now: float) -> None:
        """Drop what ended by ``now`` (leases)."""
        ...

    def sibling_prefill(self) -> Mapping[str, int]:
        """Per replica, the siblings' prefill tokens there without a first token."""
        ...


class CountCredit:
    """A region of one balancer: the page's running + waiting count credits the pushes it
    shows; the whole budget is this balancer's."""

    shared = False

    def units_on(self, replica_id: str, dispatch_budget: int) -> int:
        return dispatch_budget

    def unseen_elsewhere(self, replica_id: str) -> int:
        return 0

    def page_shows_until(self, sent_at: float | None) -> float | None:
        return None

    def charged_after_page(self, pushed_at: Sequence[float], shows_until: float | None, *, in_flight: int,
                           num_running: int, num_waiting: int) -> int:
        # which of the unstarted requests the page shows is not known: the oldest, as the
        # replica admits in arrival order
        unstarted = len(pushed_at)
        started = in_flight - unstarted
        return max(0, unstarted - max(0, num_running + num_waiting - started))

    def shown_by_page(self, pushed_at: float, shows_until: float | None, *, charged: int, unstarted: int) -> bool:
        # while the page showed any unstarted push, the one leaving is taken as one of them;
        # a held replica (more charged than unstarted) gives one back
        return charged < unstarted

    def awaits_lease(self, free_here: bool) -> bool:
        return False  # the whole budget is here: nothing to lease

    def expire(self, now: float) -> None:
        pass

    def sibling_prefill(self) -> Mapping[str, int]:
        return {}


class TimeCredit:
    """A region of several balancers: a page scraped ``siblings.page_lag_s`` after a push
    shows it; this balancer uses the units of each budget it holds among its siblings."""

    shared = True

    def __init__(self, siblings: RegionSiblings) -> None:
        self.siblings = siblings

    def units_on(self, replica_id: str, dispatch_budget: int) -> int:
        return self.siblings.shares.units_on(replica_id)

    def unseen_elsewhere(self, replica_id: str) -> int:
        return self.siblings.unseen_on(replica_id)

    def page_shows_until(self, sent_at: float | None) -> float | None:
        # a push reaches the replica's page within page_lag_s (the proxy's send, the
        # server's tokenizing, one engine step), so a page scraped later shows it, running
        # or waiting; without a send time, no push counts as shown
        return None if sent_at is None else sent_at - self.siblings.page_lag_s

    def charged_after_page(self, pushed_at: Sequence[float], shows_until: float | None, *, in_flight: int,
                           num_running: int, num_waiting: int) -> int:
        # the page counts the siblings' requests too, and what they pushed since they last
        # said is not known here: its count cannot tell which pushes it shows
        if shows_until is None:
            return len(pushed_at)
        return len(pushed_at) - bisect.bisect_right(pushed_at, shows_until)

    def shown_by_page(self, pushed_at: float, shows_until: float | None, *, charged: int, unstarted: int) -> bool:
        return pushed_at <= (float("-inf") if shows_until is None else shows_until)

    def awaits_lease(self, free_here: bool) -> bool:
        return not free_here

    def expire(self, now: float) -> None:
        self.siblings.shares.expire(now)

    def sibling_prefill(self) -> Mapping[str, int]:
        return self.siblings.pending_prefill_on()


class PushBudget:
    """Per replica: the pushes charged to its budget since its last page, when the budget
    was spent, this balancer's unstarted pushes there, and the siblings' prefill there."""

    def __init__(self, dispatch_budget: int) -> None:
        self.dispatch_budget = dispatch_budget
        self.rule: CreditRule = CountCredit()
        # pushes charged to each replica's budget: not shown by its last page yet
        self._charged: dict[str, int] = {}
        # per replica whose budget is spent: when the push that spent it was (absent for a
        # replica held after a failed probe or attempt: no signal to go by)
        self._spent_at: dict[str, float] = {}
        # per replica, when this balancer pushed each of its requests there that has no
        # first token yet (in push order; its length is how many are unstarted)
        self._unstarted_pushed_at: dict[str, list[float]] = {}
        # per replica, the push time up to which its last page showed pushes (TimeCredit)
        self._page_shows_until: dict[str, float] = {}
        # per replica, the siblings' prefill tokens there without a first token (their last
        # word), included in the view's pending_prefill_tokens
        self._sibling_prefill: dict[str, int] = {}

    def attach_siblings(self, siblings: RegionSiblings) -> None:
        """This balancer is one of several in its region: pages credit pushes by time and
        it pushes within the units it holds (:class:`TimeCredit`)."""
        self.rule = TimeCredit(siblings)

    @property
    def shared(self) -> bool:
        """Each replica's budget is shared with sibling balancers."""
        return self.rule.shared

    # ------------------------------------------------------------------ membership

    def add_replica(self, replica_id: str) -> None:
        self._charged[replica_id] = 0

    def remove_replica(self, replica_id: str) -> None:
        self._charged.pop(replica_id, None)
        self._spent_at.pop(replica_id, None)
        self._sibling_prefill.pop(replica_id, None)
        self._unstarted_pushed_at.pop(replica_id, None)
        self._page_shows_until.pop(replica_id, None)

    # ------------------------------------------------------------------ reading

    def budget_of(self, replica_id: str) -> int:
        """Pushes this balancer may have unseen on ``replica_id``: the dispatch budget,
        or in a region of several balancers the units of it this one holds."""
        rule = self.rule
        # a budget of one balancer is the whole of it (CountCredit): no call per read
        return rule.units_on(replica_id, self.dispatch_budget) if rule.shared else self.dispatch_budget

    def charged(self, replica_id: str) -> int:
        """This balancer's pushes to ``replica_id`` its last page does not show yet."""
        return self._charged.get(replica_id, 0)

    def unseen_pushes(self) -> dict[str, int]:
        """Per replica, this balancer's pushes its last probe does not show yet."""
        return dict(self._charged)

    def free_here(self, replica_id: str) -> bool:
        """This balancer holds a unit of ``replica_id``'s budget it has not pushed on."""
        return self._charged[replica_id] < self.budget_of(replica_id)

    def free_slots(self, replica_id: str) -> int:
        """Requests this balancer can still push to ``replica_id`` before its next page
        (negative: more charged than it holds)."""
        return self.budget_of(replica_id) - self._charged[replica_id]

    def refresh(self, replica_id: str) -> bool:
        """After a change to ``replica_id``'s budget: a spent budget that comes back ends its
        wait (a page lagging the pushes that spends it again gives no time to go by: only a
        push does). Returns whether the replica's budget has room region-wide (the whole
        budget less every balancer's unseen pushes): the budget's part of availability."""
        charged = self._charged[replica_id]
        if charged < self.budget_of(replica_id):
            self._spent_at.pop(replica_id, None)
        return charged + self.rule.unseen_elsewhere(replica_id) < self.dispatch_budget

    def awaits_lease(self, replica_id: str) -> bool:
        """A pick of available ``replica_id`` waits for a unit its home leases (a want):
        free region-wide, not here. Never for a balancer alone in its region."""
        return self.rule.awaits_lease(self.free_here(replica_id))

    def push_rate(self, replica_id: str, now: float, first_token_s: float) -> float:
        """Requests per second ``replica_id``'s budget takes: the budget per
        ``first_token_s`` (the time a push takes to give its unit back with its first
        token), or per the time it has now been spent with none back, when that is
        longer; 0 for a budget held without a push that spent it (no time to go by)."""
        budget = self.budget_of(replica_id)
        if budget == 0:
            return 0.0
        if self._charged[replica_id] < budget:
            return budget / first_token_s
        spent_at = self._spent_at.get(replica_id)
        if spent_at is not None:
            return budget / max(first_token_s, now - spent_at)
        return 0.0

    def sibling_prefill_on(self, replica_id: str) -> int:
        """The siblings' prefill tokens on ``replica_id`` in its view (their last word)."""
        return self._sibling_prefill.get(replica_id, 0)

    def sibling_prefill_total(self) -> int:
        return sum(self._sibling_prefill.values())

    # ------------------------------------------------------------------ events

    def on_page(self, replica_id: str, *, healthy: bool, in_flight: int, num_running: int, num_waiting: int,
                sent_at: float | None) -> None:
        """A probe of ``replica_id``: a healthy page credits the pushes it shows (the
        rule's call); pushes it does not show yet stay charged. A failed one charges
        nothing."""
        if not healthy:
            self._charged[replica_id] = 0
            return
        shows_until = self.rule.page_shows_until(sent_at)
        if shows_until is None:
            self._page_shows_until.pop(replica_id, None)
        else:
            self._page_shows_until[replica_id] = shows_until
        self._charged[replica_id] = self.rule.charged_after_page(
            self._unstarted_pushed_at.get(replica_id, []), shows_until, in_flight=in_flight,
            num_running=num_running, num_waiting=num_waiting)

    def pushed(self, replica_id: str, now: float) -> None:
        """A push to ``replica_id`` at ``now`` takes a unit."""
        self._charged[replica_id] += 1
        if self._charged[replica_id] >= self.budget_of(replica_id):
            self._spent_at[replica_id] = now
        self._unstarted_pushed_at.setdefault(replica_id, []).append(now)

    def hold(self, replica_id: str) -> None:
        """No push to ``replica_id`` until its next page: its whole budget is charged (with
        no push that spent it)."""
        self._charged[replica_id] = self.dispatch_budget
        self._spent_at.pop(replica_id, None)

    def unit_back(self, replica_id: str, pushed_at: float) -> None:
        """The push made at ``pushed_at`` got its first token, or left before one: its unit
        comes back, unless the last page already showed it (giving it back twice would let
        one push more than the budget past the page)."""
        unstarted = len(self._unstarted_pushed_at.get(replica_id, ()))
        charged = self._charged[replica_id]
        self.forget_unstarted(replica_id, pushed_at)
        shown = self.rule.shown_by_page(pushed_at, self._page_shows_until.get(replica_id),
                                        charged=charged, unstarted=unstarted)
        if not shown:  # not shown by the page (or held): its unit comes back
            self._charged[replica_id] = max(0, charged - 1)

    def forget_unstarted(self, replica_id: str, pushed_at: float) -> None:
        """The push made at ``pushed_at`` is no longer unstarted (no unit comes back)."""
        # a request may outlive its replica's removal and re-adding under one id: its push
        # is not in the new list (found by its push time)
        pushed = self._unstarted_pushed_at.get(replica_id)
        if pushed:
            i = bisect.bisect_left(pushed, pushed_at)
            if i < len(pushed) and pushed[i] == pushed_at:
                del pushed[i]

    def expire(self, now: float) -> None:
        """Before a dispatch round: a lease that ended since the last step ends here."""
        self.rule.expire(now)

    def renew_sibling_prefill(self) -> dict[str, int]:
        """A sibling step: the siblings' prefill on each replica becomes their latest word.
        Returns per replica the change to its view's pending_prefill_tokens."""
        latest = self.rule.sibling_prefill()
        changes: dict[str, int] = {}
        for replica_id in self._charged:
            new = latest.get(replica_id, 0)
            old = self._sibling_prefill.get(replica_id, 0)
            if new != old:
                changes[replica_id] = new - old
                if new:
                    self._sibling_prefill[replica_id] = new
                else:
                    del self._sibling_prefill[replica_id]
        return changes
