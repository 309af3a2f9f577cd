"""The simulator's state per replica and per region: a replica is the stand-in's real
:class:`Engine` with the simulator's stepping state; a region is the real
:class:`RegionCore`, built by the one assembly and driven as the balancer daemon drives it.

Apart from the event loop (skymesh/bench/des.py), which owns the clock and moves requests
and messages between these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from skymesh.assembly import sibling_settings
from skymesh.bench.sim_config import SimConfig, replica_roles, sim_region_assembly
from skymesh.replica_sim import kv_events as standin_events
from skymesh.replica_sim.engine import Engine
from skymesh.routing import kv_index
from skymesh.routing.assembly import CostSeed, build_region_core, build_siblings
from skymesh.routing.region import RegionCore


def routing_events(events: Sequence[standin_events.StandInEvent]) -> list[kv_index.KvEvent]:
    """The stand-in's vLLM-wire KV events as the routing core's (what the balancer's
    subscriber decodes them to)."""
    out: list[kv_index.KvEvent] = []
    for ev in events:
        if isinstance(ev, standin_events.BlockStored):
            out.append(kv_index.BlockStored(list(ev.block_hashes), ev.parent_block_hash, ev.token_ids,
                                            ev.block_size))
        elif isinstance(ev, standin_events.BlockRemoved):
            out.append(kv_index.BlockRemoved(list(ev.block_hashes)))
        else:
            out.append(kv_index.AllBlocksCleared())
    return out


class SimReplica:
    """One replica: its engine and where the simulator is in stepping it (``IDLE``: no
    step scheduled; ``STEP``: one engine step in flight; ``LAZY``: a fused decode stretch
    from ``t_sync``, ended by a wake-up of the current ``version``)."""

    __slots__ = ("idx", "rid", "region", "engine", "state", "t_sync", "version")
    IDLE, STEP, LAZY = 0, 1, 2

    def __init__(self, idx: int, rid: str, region: str, engine: Engine) -> None:
        self.idx, self.rid, self.region, self.engine = idx, rid, region, engine
        self.state = self.IDLE
        self.t_sync = 0.0  # LAZY: the time the engine's state is at
        self.version = 0  # invalidates a superseded wake-up


class SimRegion:
    """One simulated region: its balancers, each the real :class:`RegionCore` as the daemon
    drives it (``cores``; ``core`` is the first); ``seed``: the replicas' TTFT cost seed,
    ``num_blocks``: each replica's KV blocks. ``homes``: replica id -> the region it lives
    in, for a core whose replicas live elsewhere (the pooled bound's; residency rules then
    decide per request origin where it may run); default: ``cfg.regions[name]`` replicas
    of its own."""

    def __init__(self, name: str, cfg: SimConfig, seed: CostSeed, num_blocks: int,
                 homes: Mapping[str, str] | None = None) -> None:
        self.name = name
        n = cfg.balancers_per_region
        if n < 1:
            raise ValueError("a region needs at least one balancer")
        if homes is None:
            self.replica_ids = [f"{name}/r{i}" for i in range(cfg.regions[name])]
            self.homes = dict.fromkeys(self.replica_ids, name)
        else:
            self.replica_ids = list(homes)
            self.homes = dict(homes)
        self.cores: list[RegionCore] = []
        for k in range(n):
            core = build_region_core(sim_region_assembly(cfg, name, seed))
            core.set_replicas(self.replica_ids, 0.0, homes=homes)
            if cfg.pd_split:
                core.set_roles(replica_roles(cfg, self.replica_ids, self.homes))
            if n > 1:
                siblings = build_siblings(name, f"{name}-b{k}", core.settings.dispatch_budget,
                                          sibling_settings(cfg.routing.siblings))
                siblings.expect(f"{name}-b{j}" for j in range(n))
                core.attach_siblings(siblings)
            if core.kv_indexes is not None:
                # the subscriptions are up from the start: every (empty) cache is known
                for rid in self.replica_ids:
                    core.kv_events(rid, [], 0.0, num_blocks)
            self.cores.append(core)
        self.core = self.cores[0]
        # "events": the first balancer's index (each balancer consumes every KV event)
        self.kv_indexes = self.core.kv_indexes
        self.seq = [0] * n  # per balancer: its heartbeats' sequence
        self._next = 0

    def next_balancer(self) -> int:
        """The balancer the region's entry hands the next request to (in turn)."""
        k = self._next
        self._next = (k + 1) % len(self.cores)
        return k
