"""Members watch each other: which balancers of a region their siblings' reports take out.

Every balancer reports to the controller each second (``REPORT_INTERVAL_MS``) and names, in
``BalancerReport.unresponsive_siblings``, the siblings the topology lists alive that sent
it no sibling message for twice the siblings' dead-after time (skymesh/balancer/fleet.py).
A frozen member (SIGSTOP, a hung host) stops both: its reports and its sibling messages.

The rule, for a live member X (alive and not draining) of one region, at ``now_ms``:

- X itself has been quiet for ``quiet_ms``: nothing heard from it within that window;
- at least one other live member reported within ``quiet_ms``;
- every other live member that reported within ``quiet_ms`` names X, by balancer id, in
  that (its latest) report.

Then X is taken out. Refused, by construction: a member that still reports (a partition
between two siblings that both reach the controller takes nobody out); a verdict on
reports older than ``quiet_ms`` (a namer that went quiet too is no witness); the last live
member of a region (a witness must be live and reporting, and is never taken out itself:
the region's own failover stays with the probes). Ids a report names that are not a live
member of the region are ignored, and only ``MAX_NAMED`` names of a report are read.

``QUIET_MS`` is 2.5 report intervals: one late report (a GC pause, a slow controller) is
not quiet, two missed in a row are. Pure: no clock, no I/O; the caller passes ``now_ms``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

REPORT_INTERVAL_MS = 1000
QUIET_MS = REPORT_INTERVAL_MS * 5 // 2
# the most names read from one report (a fleet is far smaller; the rest is ignored), and
# the longest name that can be a balancer id
MAX_NAMED = 256
MAX_NAME_CHARS = 128


@dataclass(frozen=True, slots=True)
class WatchedMember:
    """One balancer of a region as the verdict sees it."""

    key: str  # the controller's key of the member
    balancer_id: str  # what siblings call it (its registration's id)
    alive: bool
    draining: bool
    # when the controller last heard from it (None: never)
    heard_at_ms: int | None
    # the balancer ids its latest report names unresponsive, and when that report came
    # (None: it has not reported)
    named_unresponsive: frozenset[str] = field(default_factory=frozenset)
    report_at_ms: int | None = None

    @property
    def live(self) -> bool:
        return self.alive and not self.draining


def bounded_names(names: Iterable[str], limit: int = MAX_NAMED) -> frozenset[str]:
    """At most ``limit`` names of a report (an untrusted list), each as given; a name too
    long to be a balancer id is skipped."""
    out: set[str] = set()
    for i, name in enumerate(names):
        if i >= limit:
            break
        if len(name) <= MAX_NAME_CHARS:
            out.add(name)
    return frozenset(out)


def _within(at_ms: int | None, now_ms: int, quiet_ms: int) -> bool:
    return at_ms is not None and now_ms - at_ms < quiet_ms


def taken_out(members: Sequence[WatchedMember], now_ms: int, quiet_ms: int = QUIET_MS) -> list[str]:
    """The keys of the members their siblings take out (see the module docstring), in the
    order given."""
    live = [m for m in members if m.live and m.balancer_id]
    out: list[str] = []
    for x in live:
        if _within(x.heard_at_ms, now_ms, quiet_ms) or _within(x.report_at_ms, now_ms, quiet_ms):
            continue
        witnesses = [m for m in live if m.key != x.key and _within(m.report_at_ms, now_ms, quiet_ms)]
        if witnesses and all(x.balancer_id in w.named_unresponsive for w in witnesses):
            out.append(x.key)
    if len(out) >= len(live):  # unreachable (a witness is never taken out): the last stays
        return []
    return out
