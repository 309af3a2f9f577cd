"""A mesh config as the typed, frozen settings a region's routing core is built from
(skymesh/routing/assembly.py): built once at start and on a reload by the balancer daemon,
and by the simulator from the same config sections (its SimConfig.routing).
Documented defaults that depend on other keys or on the replicas (the queue-wait deadline,
Retry-After, the per-token upstream bound) are computed here and nowhere else."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from skymesh.config import MeshConfig, ReplicaConfig
from skymesh.config.pairing import PairingConfig
from skymesh.config.routing import (
    HealthConfig,
    OffloadConfig,
    PolicyConfig,
    QueueConfig,
    UpstreamConfig,
)
from skymesh.config.siblings import SiblingsConfig
from skymesh.hardware import PROFILES, Profile
from skymesh.routing.assembly import (
    CostSeed,
    OffloadSettings,
    PairingSettings,
    PolicySettings,
    RegionAssembly,
    SiblingSettings,
)
from skymesh.routing.health import HealthSettings
from skymesh.routing.model import DEFAULT_FIRST_TOKEN_FIXED_S, DEFAULT_PREFILL_S_PER_TOKEN
from skymesh.routing.pairing.base import DecodeCost, KvLinks
from skymesh.routing.region_settings import RegionSettings


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """The sections of a mesh config a region's routing reads: what the daemon runs and
    what the simulator simulates (each section's defaults are the config's)."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    siblings: SiblingsConfig = field(default_factory=SiblingsConfig)
    # the mesh config's slo_early_rejection
    early_rejection: bool = True

    @classmethod
    def of(cls, cfg: MeshConfig) -> RoutingConfig:
        return cls(policy=cfg.policy, queue=cfg.queue, offload=cfg.offload, health=cfg.health,
                   upstream=cfg.upstream, siblings=cfg.siblings, early_rejection=cfg.slo_early_rejection)


def sibling_settings(siblings: SiblingsConfig) -> SiblingSettings:
    """The ``siblings:`` section as the fleet's part of the region core reads it."""
    return SiblingSettings(dead_after_s=siblings.dead_after_s, page_lag_s=siblings.page_lag_s,
                           lease_s=siblings.lease_s, clock_skew_s=siblings.clock_skew_s,
                           want_memory_s=siblings.keepalive_s)


def replica_profile(replicas: tuple[ReplicaConfig, ...]) -> tuple[Profile, float] | None:
    """The hardware profile (and time scale) of the first replica that names one (skymesh/hardware.py)."""
    for r in replicas:
        if r.sim is not None and r.sim.profile in PROFILES:
            return PROFILES[r.sim.profile], r.sim.time_scale
    return None


def cost_seed(replicas: tuple[ReplicaConfig, ...]) -> CostSeed:
    """The TTFT model's seed from the replicas' hardware profile; without one, the routing
    model's defaults."""
    found = replica_profile(replicas)
    if found is None:
        return CostSeed(DEFAULT_PREFILL_S_PER_TOKEN, DEFAULT_FIRST_TOKEN_FIXED_S)
    profile, time_scale = found
    return CostSeed(*profile.ttft_seed(time_scale))


def policy_settings(policy: PolicyConfig, name: str) -> PolicySettings:
    """``policy:`` with the policy ``name`` (the daemon's command line may override the config's)."""
    return PolicySettings(name=name, chunk_tokens=policy.chunk_tokens, ttft_slo_s=policy.ttft_slo_s,
                          trie_max_nodes=policy.trie_max_nodes, options=policy.options)


def offload_settings(offload: OffloadConfig) -> OffloadSettings:
    """``offload:`` (its rules as the allowed-target predicate)."""
    return OffloadSettings(enabled=offload.enabled, max_remote_queue=offload.max_remote_queue,
                           heartbeat_interval_s=offload.heartbeat_interval_s,
                           miss_limit=offload.heartbeat_miss_limit, trigger=offload.trigger,
                           min_gain_s=offload.min_gain_s, allowed=offload.allowed)


def max_queue_wait_s(policy: PolicyConfig, upstream: UpstreamConfig) -> float:
    """``upstream.max_queue_wait_s``; unset: max(60 s, 30 x policy.ttft_slo_s)."""
    return upstream.max_queue_wait_s or max(60.0, policy.ttft_slo_s * 30)


def per_output_token_s(upstream: UpstreamConfig, replicas: tuple[ReplicaConfig, ...]) -> float:
    """``upstream.per_output_token_s``; unset: twice the slowest step the replicas' stand-in
    profile can take (full batch, a full prefill chunk, the whole KV cache attended), as
    every running sequence gains one token per step; without a profile, 0.2 s (5 tokens/s)."""
    if upstream.per_output_token_s is not None:
        return upstream.per_output_token_s
    found = replica_profile(replicas)
    if found is None:
        return 0.2
    p, scale = found
    slowest = p.step_time_s(p.max_num_batched_tokens, p.max_num_seqs, p.kv_capacity_tokens) * scale
    return max(0.01, 2 * slowest)


def routing_region_settings(routing: RoutingConfig) -> RegionSettings:
    """The region core's settings from the config sections they come from."""
    policy, queue, health = routing.policy, routing.queue, routing.health
    return RegionSettings(
        queue_bound=policy.queue_bound,
        dispatch_budget=policy.options.dispatch_budget,
        max_retries=policy.max_retries,
        max_queue_wait_s=max_queue_wait_s(policy, routing.upstream),
        retry_after_s=max(1, round(policy.ttft_slo_s)),
        early_rejection=routing.early_rejection,
        queue_discipline=queue.discipline,
        slo_window=queue.window,
        slo_iterations=queue.iterations,
        slo_max_age_s=queue.max_age_s,
        prefix_ttft_share=queue.prefix_ttft_share,
        ttft_slo_s=policy.ttft_slo_s,
        health=HealthSettings(
            unhealthy_threshold=health.unhealthy_threshold,
            healthy_threshold=health.healthy_threshold,
        ),
    )


def region_settings(cfg: MeshConfig) -> RegionSettings:
    """The region core's settings from the mesh config (at start and on a reload)."""
    return routing_region_settings(RoutingConfig.of(cfg))


def routing_assembly(routing: RoutingConfig, region: str, *, peer_one_way_s: Mapping[str, float],
                     cost_seed: CostSeed, kv_events: bool, policy_name: str | None = None) -> RegionAssembly:
    """Everything ``region``'s core is built from: ``routing`` with the region's place in
    the mesh (one-way latency to each peer, in seconds), its replicas' cost seed, whether
    their KV events can be matched with prompts, and the policy (``policy_name`` overrides
    the config's, as the daemon's command line may)."""
    return RegionAssembly(
        region=region,
        policy=policy_settings(routing.policy, policy_name or routing.policy.name),
        offload=offload_settings(routing.offload),
        settings=routing_region_settings(routing),
        cost_seed=cost_seed,
        peer_one_way_s=peer_one_way_s,
        kv_events=kv_events,
    )


def region_assembly(cfg: MeshConfig, region: str, policy_name: str, *, kv_events: bool) -> RegionAssembly:
    """Everything ``region``'s core is built from in the mesh ``cfg``; ``kv_events``: its
    replicas' KV events can be matched with prompts (the balancer hashes token ids)."""
    peers = {r.name: cfg.one_way_ms(region, r.name) / 1000 for r in cfg.regions if r.name != region}
    assembly = routing_assembly(RoutingConfig.of(cfg), region, peer_one_way_s=peers,
                                cost_seed=cost_seed(cfg.region(region).replicas), kv_events=kv_events,
                                policy_name=policy_name)
    return replace(assembly, pairing=pairing_settings(cfg.pairing, cfg.region(region).replicas))


def pairing_settings(pairing: PairingConfig, replicas: tuple[ReplicaConfig, ...]) -> PairingSettings | None:
    """``pairing:`` as the region core's pair rule reads it (None: ``never``). The profile
    the rule prices by is ``pairing.profile``, else the stand-ins' own."""
    if pairing.rule == "never":
        return None
    if pairing.profile is not None:
        if pairing.profile not in PROFILES:
            raise ValueError(f"pairing.profile {pairing.profile!r}: no such profile (known: {', '.join(PROFILES)})")
        profile, time_scale = PROFILES[pairing.profile], 1.0
    else:
        found = replica_profile(replicas)
        if found is None:
            raise ValueError("pairing.rule needs the replicas' hardware profile: set pairing.profile "
                             f"(one of {', '.join(PROFILES)})")
        profile, time_scale = found
    links = KvLinks(bytes_per_s=pairing.link_gbps * 1e9 / 8, latency_s=pairing.link_latency_ms / 1000)
    return PairingSettings(pairing.rule, DecodeCost.of_profile(profile, time_scale), dict(pairing.options), links,
                           pairing.tbt_slo_s)
