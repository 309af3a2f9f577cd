"""The routing core's shared types and the one Policy protocol.

Everything under ``skymesh.routing`` is pure: no sockets, no clock reads (``now`` is
passed in, in seconds on any monotonic clock), no module-level mutable state. The balancer
daemon, the discrete-event simulator and the benchmarks all drive these same objects.

:class:`RoutingRequest` is defined in ``request.py`` and re-exported here: the region model
(``model.py``) reads it too, and imports nothing from this module (a :class:`PolicyContext`
carries a :class:`~skymesh.routing.model.RegionModel`, so this module imports that one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from skymesh.routing.kv_index import KvIndexes
from skymesh.routing.model import RegionModel
from skymesh.routing.options import PolicyOptions
from skymesh.routing.request import RoutingRequest

__all__ = [
    "Decision", "Migration", "Policy", "PolicyContext", "ReplicaView", "RoutingRequest",
]


# the time constant of a replica's prefill rate (ReplicaView.prefill_rate): long enough to
# span a decode's life, short enough to follow the load
PREFILL_RATE_TAU_S = 10.0


@dataclass(slots=True)
class ReplicaView:
    """The balancer's current view of one replica, as handed to a policy."""

    replica_id: str
    healthy: bool = True
    # selective pushing: the replica reported no waiting request at the last probe and the
    # balancer has not dispatched past its budget since
    available: bool = True
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    # prefill tokens dispatched to this replica that have not produced their first token
    # yet (the load signal DualMap and Mooncake use): this balancer's, and in a region of
    # several balancers its siblings' as they last said (skymesh/routing/dispatcher.py)
    pending_prefill_tokens: int = 0
    in_flight: int = 0  # dispatched by this balancer and not finished
    # decode legs of split requests (prefill elsewhere) booked here by this balancer and
    # not yet started, and the KV tokens they will hold (prompt + output); not pushes:
    # the push budget governs the replicas that prefill (skymesh/routing/pairing)
    pending_decodes: int = 0
    pending_decode_tokens: int = 0
    # uncached prompt tokens dispatched here for prefill, per second, decayed
    # exponentially (time constant PREFILL_RATE_TAU_S) since ``prefill_rate_at``: how
    # often a decode here will share its step with a prefill chunk
    prefill_rate: float = 0.0
    prefill_rate_at: float = 0.0
    prefill_rate_since: float | None = None  # the first dispatch it counts

    def prefill_rate_now(self, now: float) -> float:
        """``prefill_rate`` decayed to ``now``; over its first time constants divided by
        the weight it has had time to gather (a young average is not biased to 0)."""
        since = self.prefill_rate_since
        if since is None or now <= since:
            return 0.0
        weight = 1.0 - math.exp(-(now - since) / PREFILL_RATE_TAU_S)
        return self.prefill_rate * math.exp(-max(0.0, now - self.prefill_rate_at) / PREFILL_RATE_TAU_S) / weight

    def add_prefill(self, tokens: int, now: float) -> None:
        """``tokens`` of prefill were dispatched here at ``now``."""
        if self.prefill_rate_since is None:
            # as if counted from one time constant's hundredth earlier: a first dispatch
            # reads as a rate, not as an infinity
            self.prefill_rate_since = now - PREFILL_RATE_TAU_S / 100
        self.prefill_rate = (self.prefill_rate * math.exp(-max(0.0, now - self.prefill_rate_at) / PREFILL_RATE_TAU_S)
                             + tokens / PREFILL_RATE_TAU_S)
        self.prefill_rate_at = now


@dataclass(slots=True)
class Decision:
    """A policy's answer for one request. ``replica_id=None`` means: keep it queued."""

    replica_id: str | None
    reason: str = ""
    matched_tokens: int = 0  # prefix tokens the policy expects to hit in the replica cache
    estimated_ttft_s: float | None = None
    # a split request (skymesh/routing/pairing): its prefill runs on ``replica_id`` and its
    # decode here, the KV moved between them; None: whole
    decode_replica_id: str | None = None
    # a split request's decode leg placed again on ``replica_id`` after the first one failed
    # before its first token: the prefill's KV is still held, the driver resends the leg
    decode_leg: bool = False
    # a split request's KV move, estimated by the pair rule (seconds; 0 when whole): the
    # driver bounds the decode leg's wait for its first token by it
    transfer_s: float = 0.0


@dataclass(slots=True)
class Migration:
    """DualMap hotspot rebalancing: move a request still queued at the balancer."""

    request_id: str
    from_replica: str
    to_replica: str
    benefit_s: float


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """Settings every policy is built from (the registry passes the same one to all)."""

    chunk_tokens: int = 64
    ttft_slo_s: float = 2.0
    trie_max_nodes: int = 200_000
    # prefill cost seed for TTFT estimates before online fitting: seconds per uncached
    # prompt token and fixed seconds per request (from the replica profile)
    prefill_s_per_token: float = 300e-3 / 512
    prefill_fixed_s: float = 0.02
    seed: int = 0
    # the policy's validated options model; a raw mapping (a test, ``skymesh sim``) is
    # validated by ``make_policy`` / the policy against the policy's own options model
    options: PolicyOptions | Mapping[str, Any] = field(default_factory=PolicyOptions)
    # the replicas' KV-event indexes (exact cache state) of a policy built without a model;
    # None: routing history only
    kv_indexes: KvIndexes | None = None
    # the region's model (cost model and CacheView, the KV-event indexes in it), shared
    # with offload and the queue discipline; None: a policy that needs one builds its own
    # from the fields above
    model: RegionModel | None = None

    def standalone_model(self) -> RegionModel:
        """The model a policy built on its own (no region's model here) reads."""
        return RegionModel(chunk_tokens=self.chunk_tokens,
                           prefill_s_per_token=self.prefill_s_per_token,
                           first_token_fixed_s=self.prefill_fixed_s,
                           trie_max_nodes=self.trie_max_nodes, kv_indexes=self.kv_indexes)


@runtime_checkable
class Policy(Protocol):
    """One routing policy. Implementations live one per file in ``policies/``.

    Call order per request: ``choose`` (possibly several times while the request waits),
    then ``on_dispatch`` once it is sent, ``on_first_token`` when its first token comes back
    (not for a non-streaming answer, whose first byte is its last), ``on_complete`` when it
    ends (``ok`` False on failure). ``set_replicas`` is called on every membership change
    with the full current list.

    Requests wait at the balancer (selective pushing), highest priority (SLO class) first
    and, within a priority, in the queue discipline's order (arrival order under ``fcfs``);
    the dispatcher offers them in that order to ``choose`` whenever some replica is
    available. ``choose`` must return an available, healthy replica or ``None`` (hold the
    request; besides "none available", only DualMap holds while a replica is free: for a
    busy candidate estimated faster than the free choice, or, with ``max_hold_fraction``,
    within a share of the SLO's slack). ``rebalance`` runs periodically over the
    still-queued requests; a policy that holds requests for a replica may move them
    (DualMap hotspot migration) and reports the moves it made.
    """

    name: str

    def set_replicas(self, replica_ids: Sequence[str]) -> None: ...

    def choose(
        self, req: RoutingRequest, replicas: Mapping[str, ReplicaView], now: float
    ) -> Decision: ...

    def on_dispatch(self, req: RoutingRequest, replica_id: str, now: float) -> None: ...

    def on_first_token(
        self, req: RoutingRequest, replica_id: str, ttft_s: float, now: float
    ) -> None: ...

    def on_complete(self, req: RoutingRequest, replica_id: str, ok: bool, now: float) -> None: ...

    def rebalance(
        self, queued: Sequence[RoutingRequest], replicas: Mapping[str, ReplicaView], now: float
    ) -> list[Migration]: ...

    def stats(self) -> dict[str, Any]: ...
