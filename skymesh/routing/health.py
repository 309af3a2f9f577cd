"""Replica health with hysteresis, the only writer of the dispatcher's health flags.

Envoy-style: ``unhealthy_threshold`` consecutive failures (failed probes, or connection
failures the region core counts against health) eject a replica; ``healthy_threshold``
consecutive good probes bring an ejected one back; a replica never seen healthy joins on
its first good probe. A failure short of ejection holds the replica (no new work until its
next good probe). :class:`ReplicaHealth` owns each replica's counts and says what a
probe or a failure changed; the region core acts on it (an ejection abandons what had not
started there)."""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from skymesh.routing.dispatcher import BalancerCore


@dataclass(frozen=True, slots=True)
class HealthSettings:
    """The hysteresis thresholds: consecutive failures to eject, consecutive good probes to
    bring an ejected replica back."""

    unhealthy_threshold: int = 3
    healthy_threshold: int = 2


@dataclass(frozen=True, slots=True)
class ProbeSample:
    """One successful scrape of a replica's metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    # when the scrape was sent, on the caller's clock (None: not known); a region of
    # several balancers credits its pushes by it (BalancerCore.update_replica)
    sent_at: float | None = None


class HealthChange(StrEnum):
    """What one probe or failure did to a replica."""

    UNKNOWN = "unknown"  # not a replica this region tracks: nothing changed
    HEALTHY = "healthy"  # a good probe: its metrics are fresh (it may have joined or come back)
    HELD = "held"  # a failure short of ejection (or while ejected): no new work until a good probe
    EJECTED = "ejected"  # the failure that crossed the threshold: it takes no work at all


@dataclass(slots=True)
class ReplicaHealthState:
    ejected: bool = True  # until the first good probe
    ever_healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    ejections: int = 0
    # the next good probe brings it back at once (its last failure was judged against a
    # request, not the replica: skymesh/routing/harm.py)
    readmit: bool = False

    @property
    def out_of_service(self) -> bool:
        """Ejected after it was once healthy (one never probed yet still counts as usable)."""
        return self.ejected and self.ever_healthy


class ReplicaHealth:
    def __init__(self, dispatcher: BalancerCore, settings: HealthSettings) -> None:
        self.settings = settings
        self._dispatcher = dispatcher
        self._states: dict[str, ReplicaHealthState] = {}

    def track(self, replica_ids: Iterable[str]) -> None:
        """Replicas joined: each starts ejected until its first good probe (kept if known)."""
        for rid in replica_ids:
            self._states.setdefault(rid, ReplicaHealthState())

    def forget(self, replica_id: str) -> None:
        self._states.pop(replica_id, None)

    def probed(self, replica_id: str, sample: ProbeSample | None) -> HealthChange:
        """A probe result: ``sample`` None when the scrape failed or made no sense."""
        h = self._states.get(replica_id)
        if h is None or replica_id not in self._dispatcher.replicas:
            return HealthChange.UNKNOWN
        if sample is None:
            return self._failed(replica_id, h)
        h.consecutive_failures = 0
        h.consecutive_successes += 1
        if h.ejected and (not h.ever_healthy or h.readmit
                          or h.consecutive_successes >= self.settings.healthy_threshold):
            h.ejected = False
            h.ever_healthy = True
        h.readmit = False
        self._dispatcher.update_replica(
            replica_id,
            healthy=not h.ejected,
            num_running=sample.num_running,
            num_waiting=sample.num_waiting,
            kv_usage=sample.kv_usage,
            sent_at=sample.sent_at,
        )
        return HealthChange.HEALTHY

    def readmit_on_next_probe(self, replica_id: str) -> None:
        """Its failure was a request's doing: one good probe brings it back, not
        ``healthy_threshold`` of them."""
        h = self._states.get(replica_id)
        if h is not None:
            h.readmit = True

    def failed(self, replica_id: str) -> HealthChange:
        """An attempt on ``replica_id`` failed in a way that counts against its health."""
        h = self._states.get(replica_id)
        if h is None:
            return HealthChange.UNKNOWN
        return self._failed(replica_id, h)

    def _failed(self, replica_id: str, h: ReplicaHealthState) -> HealthChange:
        h.consecutive_successes = 0
        h.consecutive_failures += 1
        if not h.ejected and h.consecutive_failures >= self.settings.unhealthy_threshold:
            h.ejected = True
            h.ejections += 1
            self._dispatcher.eject(replica_id)
            return HealthChange.EJECTED
        # not ejected yet, but no fresh "nothing waiting" signal: no new work until the
        # next good probe (selective pushing); what it is already serving stays there
        self._dispatcher.hold(replica_id)
        return HealthChange.HELD

    def any_usable(self, excluding: Set[str]) -> bool:
        """Some replica outside ``excluding`` is healthy or not yet probed."""
        return any(rid not in excluding and not h.out_of_service for rid, h in self._states.items())

    def ejected_count(self) -> int:
        return sum(1 for h in self._states.values() if h.out_of_service)

    def report(self, replica_id: str) -> dict[str, Any]:
        """``replica_id``'s health for /admin/status ({} if not tracked)."""
        h = self._states.get(replica_id)
        if h is None:
            return {}
        return {
            "ejected": h.ejected,
            "consecutive_failures": h.consecutive_failures,
            "consecutive_successes": h.consecutive_successes,
            "ejections": h.ejections,
        }
