"""What a pair rule is: given the replica a policy picked for a request's prefill, a pair
rule (:class:`PairRule`) says where the request runs: whole on one replica (aggregated),
or its prefill on one and its decode on another, with the KV cache moved between them.

Roles (:data:`Role`): a replica is ``both`` (the default: it serves whole requests and may
take either leg of a split one), ``prefill`` (prefill legs only) or ``decode`` (decode
legs, and whole requests a rule sends it when its own cache makes prefill cheap, as the
peers' threshold rule does). Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from skymesh.hardware import Profile
    from skymesh.routing.base import Decision, ReplicaView, RoutingRequest
    from skymesh.routing.model import RegionModel

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("both", "prefill", "decode")


def does_prefill(role: str) -> bool:
    """A replica of ``role`` may run a request's prefill (a prefill leg or a whole request
    the policy picks it for)."""
    return role != "decode"


def does_decode(role: str) -> bool:
    """A replica of ``role`` may run a request's decode leg."""
    return role != "prefill"


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """One replica's engine step, as the profile's roofline costs it (skymesh/hardware.py
    ``Profile.step_time_s``), for pricing decode legs; and what moving KV costs."""

    weight_read_s: float
    compute_s_per_token: float
    attn_s_per_context_token: float
    decode_s_per_seq: float
    max_num_batched_tokens: int
    kv_capacity_tokens: int
    kv_bytes_per_token: int

    @classmethod
    def of_profile(cls, profile: Profile, time_scale: float = 1.0) -> DecodeCost:
        """A hardware profile's step roofline, KV capacity and KV size."""
        return cls(weight_read_s=profile.weight_read_s * time_scale,
                   compute_s_per_token=profile.compute_s_per_token * time_scale,
                   attn_s_per_context_token=profile.attn_s_per_context_token * time_scale,
                   decode_s_per_seq=profile.decode_s_per_seq * time_scale,
                   max_num_batched_tokens=profile.max_num_batched_tokens,
                   kv_capacity_tokens=profile.kv_capacity_tokens, kv_bytes_per_token=profile.kv_bytes_per_token)

    def step_s(self, prefill_tokens: int, decodes: int, context_tokens: int) -> float:
        """One engine step carrying ``prefill_tokens`` of prefill beside ``decodes``
        decoding sequences that read ``context_tokens`` KV tokens (prefill attention
        left out: the chunk's linear cost dominates it)."""
        return (max(self.weight_read_s, self.compute_s_per_token * (prefill_tokens + decodes))
                + self.attn_s_per_context_token * context_tokens + self.decode_s_per_seq * decodes)


@dataclass(frozen=True, slots=True)
class KvLinks:
    """The links KV moves over between two replicas of the region: bandwidth in bytes per
    second and one-way latency, by default and per ordered pair (prefill, decode)."""

    bytes_per_s: float = 100e9 / 8  # 100 Gbit/s, one RDMA NIC's share
    latency_s: float = 0.0005
    pairs: Mapping[tuple[str, str], tuple[float, float]] = field(default_factory=dict)

    def transfer_s(self, prefill: str, decode: str, nbytes: float) -> float:
        bw, lat = self.pairs.get((prefill, decode), (self.bytes_per_s, self.latency_s))
        return lat + nbytes / bw


@dataclass(frozen=True, slots=True)
class PairContext:
    """What the region gives every pair rule it builds."""

    model: RegionModel
    cost: DecodeCost
    links: KvLinks = KvLinks()
    ttft_slo_s: float = 2.0
    # the TBT target of a request whose class names none (Mooncake's: the mean of its
    # longest 10% token intervals)
    tbt_slo_s: float = 0.1
    # Mooncake's early rejection: a request no placement is expected to serve within both
    # its targets is refused (429) rather than placed where it misses them least (the
    # region's ``early_rejection``; a peer's forward is placed: its origin judged it)
    refuse_unmet: bool = False


@dataclass(frozen=True, slots=True)
class PairOptions:
    """Options every pair rule has (none); each rule's options extend it."""


@dataclass(frozen=True, slots=True)
class PairChoice:
    """Where a request runs: its prefill (or the whole request) on ``prefill_replica_id``
    and, when split, its decode on ``decode_replica_id``."""

    prefill_replica_id: str
    decode_replica_id: str | None = None
    reason: str = ""
    matched_tokens: int = 0  # prompt tokens the prefill replica is expected to hold
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    transfer_s: float = 0.0  # the KV's move, estimated (0 when aggregated)
    # no placement is expected to meet the request's targets: it is refused (429), and
    # the rest describes the best placement it had
    refused: bool = False

    @property
    def split(self) -> bool:
        return self.decode_replica_id is not None


class PairRule(Protocol):
    """One pair rule (``pairing/*.py``). ``choose`` gets the policy's decision (a prefill
    replica, available) and every replica the request may run on (``views``, decode-only
    ones included; ``roles`` by replica, missing ones ``both``); it returns where the
    request runs, a refusal (``refused``: no placement meets its targets), or None to keep
    it queued (no decode replica can take it now)."""

    name: str

    def choose(self, req: RoutingRequest, decision: Decision, views: Mapping[str, ReplicaView],
               roles: Mapping[str, Role], excluded: AbstractSet[str], now: float) -> PairChoice | None: ...

    def plan_roles(self, configured: Mapping[str, Role], views: Mapping[str, ReplicaView],
                   now: float) -> Mapping[str, Role] | None:
        """The roles the region's replicas should have for new work from ``now`` on, given
        the ``configured`` ones (missing: ``both``); None: no change (the configured roles,
        or the last plan, stand). A role change never moves work already placed."""
        ...
