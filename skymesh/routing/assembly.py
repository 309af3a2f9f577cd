"""One region's routing core from typed, frozen settings: the one builder the balancer
daemon and the discrete-event simulator both call, so a routing parameter reaches the
policy, the offload router, the region model and the region core the same way in both.

The settings come from a mesh config's routing sections through skymesh/assembly.py, in
the daemon and the simulator alike (skymesh/bench/sim_config.py turns its
``SimConfig.routing`` the same way, then sets offload on or off and drops the queue-wait
deadline); this module only puts the parts together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from skymesh.routing.base import PolicyContext
from skymesh.routing.kv_index import KvIndexes
from skymesh.routing.model import RegionModel
from skymesh.routing.offload import OffloadRouter, OffloadTrigger, snapshot_trie_max_nodes
from skymesh.routing.options import PolicyOptions
from skymesh.routing.pair_registry import make_pair_rule
from skymesh.routing.pairing.base import DecodeCost, KvLinks, PairContext
from skymesh.routing.region import RegionCore
from skymesh.routing.region_settings import RegionSettings
from skymesh.routing.registry import make_policy
from skymesh.routing.siblings import RegionSiblings


def allow_every_target(source: str, target: str) -> bool:
    """The offload rule of a mesh without rules: every peer is a target."""
    return True


@dataclass(frozen=True, slots=True)
class CostSeed:
    """The region's TTFT model before it refits online: seconds per uncached prompt token
    and fixed seconds per request (from the replicas' hardware profile)."""

    prefill_s_per_token: float
    first_token_fixed_s: float


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """The routing policy by its registry name, its options and what every policy reads."""

    name: str
    chunk_tokens: int
    ttft_slo_s: float
    trie_max_nodes: int
    # the policy's validated options, or a raw mapping its options model validates
    options: PolicyOptions | Mapping[str, Any] = field(default_factory=PolicyOptions)


@dataclass(frozen=True, slots=True)
class OffloadSettings:
    """When and where the region forwards queued requests to peer regions."""

    enabled: bool
    max_remote_queue: int
    heartbeat_interval_s: float
    # a peer missing this many heartbeat intervals is unavailable
    miss_limit: int
    trigger: OffloadTrigger
    min_gain_s: float
    allowed: Callable[[str, str], bool] = allow_every_target


@dataclass(frozen=True, slots=True)
class PairingSettings:
    """Prefill/decode pairs (skymesh/routing/pairing): the pair rule by its registry name
    (skymesh/routing/pair_registry.py) and options, the replicas' step and KV costs, the
    links KV moves over and the TBT target of a request without a class."""

    rule: str
    cost: DecodeCost
    options: Mapping[str, Any] = field(default_factory=dict)
    links: KvLinks = KvLinks()
    tbt_slo_s: float = 0.1


@dataclass(frozen=True, slots=True)
class RegionAssembly:
    """Everything one region's core is built from."""

    region: str
    policy: PolicySettings
    offload: OffloadSettings
    settings: RegionSettings
    cost_seed: CostSeed
    # one-way latency to each peer region, in seconds (the link RTT is twice it)
    peer_one_way_s: Mapping[str, float]
    # the replicas publish KV events: the region model gets the per-replica block indexes
    kv_events: bool
    # prefill/decode pairs; None: every request runs whole where the policy puts it
    pairing: PairingSettings | None = None


@dataclass(frozen=True, slots=True)
class SiblingSettings:
    """How the balancers of a region share its push budget (``siblings:``; docs/routing.md,
    "A region is a fleet")."""

    # a sibling silent this long no longer counts in the region's load; a gap this long
    # between steps means this balancer's loop stood still
    dead_after_s: float
    page_lag_s: float
    lease_s: float
    clock_skew_s: float
    # a want is remembered this long (a keepalive)
    want_memory_s: float


def build_siblings(region: str, balancer_id: str, dispatch_budget: int, settings: SiblingSettings, *,
                   epoch: int = 1, started_at: float = 0.0) -> RegionSiblings:
    """One balancer's share of its region's fleet: the one builder the daemon's
    RegionFleet and the simulator's regions both call."""
    return RegionSiblings(region, balancer_id, dispatch_budget, epoch=epoch, dead_after_s=settings.dead_after_s,
                          started_at=started_at, page_lag_s=settings.page_lag_s, lease_s=settings.lease_s,
                          skew_margin_s=settings.clock_skew_s, want_memory_s=settings.want_memory_s)


def build_region_core(assembly: RegionAssembly) -> RegionCore:
    """The region core: the policy from the registry, the offload router and the region
    model (cost model and CacheView) that the policy, offload and the queue discipline share."""
    policy, seed = assembly.policy, assembly.cost_seed
    kv_indexes = KvIndexes(chunk_tokens=policy.chunk_tokens) if assembly.kv_events else None
    model = RegionModel(chunk_tokens=policy.chunk_tokens, prefill_s_per_token=seed.prefill_s_per_token,
                        first_token_fixed_s=seed.first_token_fixed_s, trie_max_nodes=policy.trie_max_nodes,
                        kv_indexes=kv_indexes)
    ctx = PolicyContext(
        chunk_tokens=policy.chunk_tokens,
        ttft_slo_s=policy.ttft_slo_s,
        trie_max_nodes=policy.trie_max_nodes,
        prefill_s_per_token=seed.prefill_s_per_token,
        prefill_fixed_s=seed.first_token_fixed_s,
        options=policy.options,
        model=model,
    )
    core = RegionCore(assembly.region, make_policy(policy.name, ctx), build_offload_router(assembly),
                      assembly.settings, model)
    pairing = assembly.pairing
    if pairing is not None:
        core.local.pair_rule = make_pair_rule(pairing.rule, pairing.options, PairContext(
            model=model, cost=pairing.cost, links=pairing.links, ttft_slo_s=policy.ttft_slo_s,
            tbt_slo_s=pairing.tbt_slo_s, refuse_unmet=assembly.settings.early_rejection))
    return core


def build_offload_router(assembly: RegionAssembly) -> OffloadRouter:
    """The region's offload router: link RTTs from the one-way latencies, peer snapshots'
    tries a fraction of the region's own."""
    off, policy, seed = assembly.offload, assembly.policy, assembly.cost_seed
    rtt_s = {peer: 2 * one_way for peer, one_way in assembly.peer_one_way_s.items()}
    return OffloadRouter(
        assembly.region,
        rtt_s,
        allowed=off.allowed,
        max_remote_queue=off.max_remote_queue,
        heartbeat_interval_s=off.heartbeat_interval_s,
        miss_limit=off.miss_limit,
        trie_max_nodes=snapshot_trie_max_nodes(policy.trie_max_nodes),
        enabled=off.enabled,
        trigger=off.trigger,
        min_gain_s=off.min_gain_s,
        prefill_s_per_token=seed.prefill_s_per_token,
        first_token_fixed_s=seed.first_token_fixed_s,
        chunk_tokens=policy.chunk_tokens,
    )
