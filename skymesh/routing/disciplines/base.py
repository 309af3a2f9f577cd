"""What a queue discipline is: :class:`QueueDiscipline`, told of every request joining and
leaving the balancer's queue, of every dispatch and of the blocks replicas report cached
(KV events), gives the order in which the dispatcher offers queued requests to the
policy. ``fcfs`` is no discipline at all: the dispatcher keeps the queue's own order.
Priorities always come first; the discipline decides within one. Every hook has a
default that does nothing (and the default order is the queue's own), so a discipline
implements only what it needs. Pure: no clock (``now`` is passed in), no I/O.

A discipline's options are a frozen dataclass extending :class:`DisciplineOptions`, its
fields named as the config's ``queue:`` keys (``max_age_s``, ``window``, ...); what the
region gives every discipline it builds is a :class:`DisciplineContext`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from skymesh.routing.queueing import PriorityQueue

if TYPE_CHECKING:
    from skymesh.routing.base import ReplicaView, RoutingRequest
    from skymesh.routing.model import RegionModel

# the slo and prefix disciplines' starvation bound: queued this long, a request goes first
DEFAULT_MAX_AGE_S = 30.0


@dataclass(frozen=True, slots=True)
class DisciplineOptions:
    """Options every discipline has (none); each discipline's options extend it."""

    @classmethod
    def from_queue_settings(cls, settings: Mapping[str, Any]) -> Self:
        """These options from the queue's settings by key (the config's ``queue:`` keys);
        the keys this discipline does not read are ignored, the ones missing keep their
        defaults."""
        return cls(**{f.name: settings[f.name] for f in dataclasses.fields(cls) if f.name in settings})


@dataclass(frozen=True, slots=True)
class DisciplineContext:
    """What the region core gives every discipline it builds."""

    # the region's model: its chunk size, its cost model (prefill priced as the policy and
    # offload price it) and its CacheView (the one the policy reads)
    model: RegionModel
    # the TTFT target of a request without an SLO class
    default_slo_s: float


class QueueDiscipline:
    """A queue discipline (``slo``, ``prefix``; ``fcfs`` has none). The defaults do nothing
    and keep the queue's order: override the hooks the discipline needs."""

    def set_replicas(self, replica_ids: Sequence[str]) -> None:
        """The region's replicas are now ``replica_ids``."""

    def on_queued(self, req: RoutingRequest) -> None:
        """A request joined the queue (new, or back after a failed attempt or a peer's refusal)."""

    def on_dequeued(self, request_id: str) -> None:
        """A request left the queue (placed, offloaded, cancelled, expired)."""

    def on_dispatch(self, req: RoutingRequest, replica_id: str, now: float) -> None:
        """``req`` was sent to ``replica_id``."""

    def on_cached(self, replica_id: str, chunk_hashes: Iterable[int]) -> None:
        """A replica's KV events stored these blocks (the balancer's chunk hashes)."""

    def dispatch_order(self, queue: PriorityQueue[Any], replicas: Mapping[str, ReplicaView],
                       free_slots: Mapping[str, int], now: float,
                       excluded: Callable[[str], AbstractSet[str]] | None = None) -> list[str]:
        """The ids of every queued request, in the order to offer them to the policy;
        ``excluded(request_id)``: the replicas that request may not run on."""
        return queue.ids()

    def stats(self) -> dict[str, int]:
        """The discipline's own counters (the dispatcher's stats show them)."""
        return {}
