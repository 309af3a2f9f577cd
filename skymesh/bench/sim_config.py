"""What the discrete-event simulator simulates (:class:`SimConfig`) and how one simulated
region's routing core is assembled from it.

Kept apart from the event loop (skymesh/bench/des.py) so that the command line's setup
(skymesh/bench/sim_setup.py) and the assembly test can build and compare simulator settings
without the simulator itself: the routing it simulates is the mesh config's
``RoutingConfig``, turned into region settings by the same ``routing_assembly`` the daemon
uses (skymesh/assembly.py), with the simulator's declared differences applied here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from skymesh.assembly import RoutingConfig, routing_assembly
from skymesh.config import SloClassConfig
from skymesh.config.routing import PolicyConfig
from skymesh.hardware import PROFILES
from skymesh.routing.assembly import CostSeed, PairingSettings, RegionAssembly
from skymesh.routing.pairing.base import ROLES, DecodeCost, KvLinks, Role
from skymesh.word_tokenizer import TRACE_BLOCK_TOKENS

# the queue bound of every benchmark, simulated or live: effectively unbounded, so a
# goodput sweep measures every request instead of refusing some as queue_full
BENCH_QUEUE_BOUND = 1_000_000


def simulated_policy(name: str = "dualmap", **keys: Any) -> PolicyConfig:
    """``policy:`` as the simulator runs it unless ``keys`` say otherwise: an unbounded
    queue (goodput sweeps measure every request) and a routing chunk of one trace block."""
    return PolicyConfig.model_validate({"name": name, "queue_bound": BENCH_QUEUE_BOUND, "chunk_tokens": TRACE_BLOCK_TOKENS,
                                        **keys})


@dataclass(frozen=True)
class SimConfig:
    """What is simulated: the regions, their links and replicas, the engine's block size,
    what is recorded; and the routing the simulated balancers run (``routing``, the mesh
    config's sections: every routing parameter is named there)."""

    regions: dict[str, int] = field(default_factory=lambda: {"central": 16})  # region -> replicas
    one_way_ms: dict[tuple[str, str], float] = field(default_factory=dict)
    profile: str = "h100-qwen2.5-7b"
    routing: RoutingConfig = field(default_factory=lambda: RoutingConfig(policy=simulated_policy()))
    block_size: int = 16  # engine KV block; the KV capacity in tokens stays the profile's
    sample_load_every_s: float = 1.0
    plot_replicas: int = 32  # per-replica load series kept for the plot
    fuse_decode: bool = True  # False: one event per engine step (the reference for tests)
    # what cache-aware policies read of a replica's cache: "history" (the routing-history
    # trie: what the balancer sent where) or "events" (the replicas' KV events in the
    # region core's per-replica block index, as with vLLM's --kv-events-config). "events"
    # gives requests token ids and needs routing.policy.chunk_tokens == block_size.
    cache_view: str = "history"
    # SLO classes by name (a trace request's ``slo_class`` picks one; unknown or "": none):
    # their targets and priorities reach the region core as the balancer stamps them
    slo_classes: dict[str, SloClassConfig] = field(default_factory=dict)
    # active-active balancers per region (docs/routing.md, "A region is a fleet"): clients'
    # requests are spread over them in turn (the region's L4 entry), each probes every
    # replica, and they exchange their state every routing.siblings.interval_s, arriving
    # sibling_delay_s later
    balancers_per_region: int = 1
    sibling_delay_s: float = 0.0005
    # the pooled bound (skymesh/bench/des.py, "The pooled bound"): every replica of every
    # region behind one region core (POOL), clients paying the link to the replica's region
    pooled: bool = False
    # prefill/decode pairs (skymesh/routing/pairing): per region, how many of its replicas
    # are prefill-only and how many decode-only (the first ones, then the next ones; the
    # rest are ``both``), the pair rule (skymesh/routing/pair_registry.py) and its options,
    # the links KV moves over, and the TBT target a request without a class is priced by
    pd_split: dict[str, tuple[int, int]] = field(default_factory=dict)
    pair_rule: str = "never"
    pair_options: dict[str, Any] = field(default_factory=dict)
    kv_links: KvLinks = KvLinks()
    tbt_slo_s: float = 0.1
    # record each request's TBT (the mean of its longest 10% token intervals, Mooncake's):
    # per-step intervals are then kept through fused decode stretches
    record_tbt: bool = False

    @property
    def offload(self) -> bool:
        """Whether the regions offload to each other (with one region there is no peer;
        the pooled bound has one region core and so no peer either)."""
        return self.routing.offload.enabled and len(self.regions) > 1 and not self.pooled

    def latency_s(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        return self.one_way_ms.get((a, b), self.one_way_ms.get((b, a), 0.0)) / 1000.0


# the pooled bound's one region core (its replicas keep their own regions as their homes)
POOL = "pool"


def pool_homes(cfg: SimConfig) -> dict[str, str]:
    """The pooled bound's replicas, each with its home region: the mesh's replica ids
    (``REGION/rI``), in the mesh's order."""
    return {f"{name}/r{i}": name for name, n in cfg.regions.items() for i in range(n)}


def sim_region_assembly(cfg: SimConfig, name: str, seed: CostSeed) -> RegionAssembly:
    """What one simulated region's core is built from: the routing it simulates, turned
    into settings as the daemon turns a mesh config (skymesh/assembly.py). The pooled
    bound's core (``POOL``) has no peer: its offload rules only decide residency."""
    peers = {} if name == POOL else {o: cfg.latency_s(name, o) for o in cfg.regions if o != name}
    assembly = routing_assembly(cfg.routing, name, peer_one_way_s=peers, cost_seed=seed,
                                kv_events=cfg.cache_view == "events")
    pairing = None
    if cfg.pair_rule != "never":
        pairing = PairingSettings(cfg.pair_rule, DecodeCost.of_profile(PROFILES[cfg.profile]), cfg.pair_options,
                                  cfg.kv_links, cfg.tbt_slo_s)
    return replace(assembly, offload=replace(assembly.offload, enabled=cfg.offload), pairing=pairing,
                   # no queue-wait deadline: goodput sweeps measure every request's TTFT however late
                   settings=replace(assembly.settings, max_queue_wait_s=None))


def replica_roles(cfg: SimConfig, replica_ids: list[str], homes: dict[str, str]) -> dict[str, Role]:
    """Each replica's role by ``cfg.pd_split``: of each region's replicas (in order), the
    first are prefill-only, the next decode-only, the rest ``both``."""
    roles: dict[str, Role] = {}
    seen: dict[str, int] = {}
    for rid in replica_ids:
        region = homes[rid]
        n_prefill, n_decode = cfg.pd_split.get(region, (0, 0))
        k = seen[region] = seen.get(region, -1) + 1
        roles[rid] = ROLES[1] if k < n_prefill else ROLES[2] if k < n_prefill + n_decode else ROLES[0]
    return roles
