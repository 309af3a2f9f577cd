"""Discrete-event mode: the routing core and the stand-in's engine on a simulated clock.

Every region runs the real :class:`BalancerCore` (selective pushing, probes every
``probe_interval_s`` reading the engine's ``num_waiting`` / ``num_running`` /
``kv_cache_usage``) with a policy from the registry and, with offload on, the real
:class:`OffloadRouter` fed by heartbeats that take the configured one-way latency to
arrive. Replicas are the real :class:`Engine`. Nothing here reimplements routing or the
engine's scheduling: the simulator only moves time and messages.

Speed without approximation: while a replica's engine can only decode (nothing in prefill,
no waiting request admissible), the simulator does not step it; it schedules one wake-up
at the end of the step in which the first running request finishes (the engine's own
fused-decode cost). A request dispatched to that replica earlier cuts the stretch: the
engine is advanced (``Engine.run_until``) to the end of the step in progress at that
moment, which is exactly where a real engine would admit it. So the result equals
stepping the engine one iteration at a time, with one event per request phase instead of
one per decode step. Arrivals are pulled lazily from an iterator and per-request results
live in flat arrays, so 1M requests fit in memory.

What policies read of a replica's cache (``SimConfig.cache_view``): ``"history"`` (the
routing-history trie; chunks and engine blocks hashed from the trace's block ids) or
``"events"``: requests get token ids (:func:`trace_block_ids`), chunks are the balancer's
own :func:`~skymesh.prompt_encoder.id_chunk_hashes` over engine-block-sized chunks, and each
engine's KV events reach its region core's block index at the end of every step.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from skymesh.assembly import RoutingConfig, routing_assembly
from skymesh.bench.scores import class_summary, cv, summarize_arrays
from skymesh.bench.traces import TraceRequest, fit_request
from skymesh.config import SloClassConfig
from skymesh.config.routing import (
    PolicyConfig,
)
from skymesh.prompt_encoder import id_chunk_hashes
from skymesh.replica_sim import kv_events as standin_events
from skymesh.replica_sim.engine import Engine
from skymesh.replica_sim.profiles import PROFILES, Profile
from skymesh.replica_sim.request_state import EngineRequest
from skymesh.replica_sim.scheduler import StepOutput
from skymesh.routing import kv_index
from skymesh.routing.assembly import (
    CostSeed,
    RegionAssembly,
    build_region_core,
)
from skymesh.routing.base import RoutingRequest
from skymesh.routing.region import (
    ForwardToRegion,
    ProbeSample,
    Reject,
    SendToReplica,
)
from skymesh.slo_judge import SloClass, apply_slo_class
from skymesh.word_tokenizer import TRACE_BLOCK_TOKENS


def simulated_policy(name: str = "dualmap", **keys: Any) -> PolicyConfig:
    """``policy:`` as the simulator runs it unless ``keys`` say otherwise: an unbounded
    queue (goodput sweeps measure every request) and a routing chunk of one trace block."""
    return PolicyConfig.model_validate({"name": name, "queue_bound": 1_000_000, "chunk_tokens": TRACE_BLOCK_TOKENS,
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

    @property
    def offload(self) -> bool:
        """Whether the regions offload to each other (with one region there is no peer)."""
        return self.routing.offload.enabled and len(self.regions) > 1

    def latency_s(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        return self.one_way_ms.get((a, b), self.one_way_ms.get((b, a), 0.0)) / 1000.0


_MASK = 0xFFFF_FFFF_FFFF_FFFF


def output_block_chain(prompt_blocks: list[int], hash_ids: Sequence[int], input_len: int, output_len: int,
                       block_size: int) -> list[int]:
    """Engine block hashes of the full blocks after the prompt's full blocks: the block
    the prompt's tail shares with the first output tokens, then output only. The stand-in
    generates the same filler for every request, so these depend only on the prompt (its
    full-block chain, and the tail's trace block and length) and the position, as the live
    stand-in's text hashes do; the engine caches them as vLLM caches generated blocks."""
    full = input_len // block_size
    if len(prompt_blocks) != full:
        return []  # the trace's ids do not cover the prompt: no hash to chain from
    tail = input_len % block_size
    tail_block = (full * block_size) // TRACE_BLOCK_TOKENS
    tail_id = hash_ids[tail_block] if tail and tail_block < len(hash_ids) else -1
    prev = prompt_blocks[-1] if prompt_blocks else 0
    out: list[int] = []
    for q in range(full, (input_len + output_len) // block_size):
        prev = hash((prev, tail_id, tail, q, 2)) & _MASK
        out.append(prev)
    return out


def block_chains(hash_ids: Iterable[int], input_len: int, block_size: int,
                 chunk_tokens: int) -> tuple[list[int], tuple[int, ...]]:
    """Engine block hashes (full blocks only) and routing chunk hashes from trace block ids:
    each 512-token trace block is ``512 / size`` sub-blocks, hashed deterministically and
    chained, so equal hash-id prefixes give equal chains and nothing else does."""
    ids = list(hash_ids)
    blocks: list[int] = []
    per_block = max(1, TRACE_BLOCK_TOKENS // block_size)
    full = input_len // block_size
    prev = 0
    for h in ids:
        for j in range(per_block):
            if len(blocks) >= full:
                break
            prev = hash((prev, h, j)) & _MASK
            blocks.append(prev)
    chunks: list[int] = []
    per_chunk = max(1, TRACE_BLOCK_TOKENS // chunk_tokens)
    n_chunks = -(-input_len // chunk_tokens)
    prev = 0
    for h in ids:
        for j in range(per_chunk):
            if len(chunks) >= n_chunks:
                break
            prev = hash((prev, h, j, 1)) & _MASK
            chunks.append(prev)
    return blocks, tuple(chunks)


VOCAB = 32_000
# the filler every request's answer is made of (the stand-in generates the same text for
# every request): output block hashes depend only on the prompt tail and the position
# (ints only: hash() of ints and tuples of ints does not depend on PYTHONHASHSEED)
_OUTPUT_FILLER = tuple(hash((-1, j)) % VOCAB for j in range(TRACE_BLOCK_TOKENS))


@functools.lru_cache(maxsize=1 << 12)  # ~18 KB a block: ~75 MB at most
def trace_block_ids(h: int) -> tuple[int, ...]:
    """The token ids of one 512-token trace block: deterministic in its hash id, so equal
    hash-id prefixes are equal token prefixes (and unequal ones differ from the first
    block on)."""
    return tuple(hash((h, j)) % VOCAB for j in range(TRACE_BLOCK_TOKENS))


def prompt_token_ids(hash_ids: Sequence[int], input_len: int, request_key: int) -> list[int]:
    """A trace request's prompt as token ids: its blocks' ids, cut to ``input_len``; a
    prompt longer than its ids (a trace that does not cover it) ends in tokens of its own."""
    ids: list[int] = []
    for h in hash_ids:
        if len(ids) >= input_len:
            break
        ids.extend(trace_block_ids(h))
    k = 0
    while len(ids) < input_len:
        ids.append(hash((-2, request_key, k)) % VOCAB)
        k += 1
    del ids[input_len:]
    return ids


def token_chains(prompt_ids: Sequence[int], output_len: int, block_size: int
                 ) -> tuple[list[int], tuple[int, ...], list[int]]:
    """For the "events" cache view: the engine's block hashes (full blocks of prompt +
    answer), the routing chunk hashes (the balancer's own :func:`id_chunk_hashes` over
    ``block_size``-token chunks, so the replicas' blocks are the balancer's chunks) and
    the token ids behind the blocks (KV events carry them)."""
    n_out = output_len
    out_ids = (_OUTPUT_FILLER * (n_out // len(_OUTPUT_FILLER) + 1))[:n_out]
    all_ids = [*prompt_ids, *out_ids]
    chunks = id_chunk_hashes(prompt_ids, block_size)
    full = len(all_ids) // block_size
    blocks = list(id_chunk_hashes(all_ids[: full * block_size], block_size))
    return blocks, chunks, all_ids


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


def sim_region_assembly(cfg: SimConfig, name: str, seed: CostSeed) -> RegionAssembly:
    """What one simulated region's core is built from: the routing it simulates, turned
    into settings as the daemon turns a mesh config (skymesh/assembly.py)."""
    peers = {o: cfg.latency_s(name, o) for o in cfg.regions if o != name}
    assembly = routing_assembly(cfg.routing, name, peer_one_way_s=peers, cost_seed=seed,
                                kv_events=cfg.cache_view == "events")
    return replace(assembly, offload=replace(assembly.offload, enabled=cfg.offload),
                   # no queue-wait deadline: goodput sweeps measure every request's TTFT however late
                   settings=replace(assembly.settings, max_queue_wait_s=None))


class _Replica:
    __slots__ = ("idx", "rid", "region", "engine", "state", "t_sync", "version")
    IDLE, STEP, LAZY = 0, 1, 2

    def __init__(self, idx: int, rid: str, region: str, engine: Engine) -> None:
        self.idx, self.rid, self.region, self.engine = idx, rid, region, engine
        self.state = self.IDLE
        self.t_sync = 0.0  # LAZY: the time the engine's state is at
        self.version = 0  # invalidates a superseded wake-up


class _Region:
    """One simulated region: the real :class:`RegionCore`, as the daemon drives it."""

    def __init__(self, name: str, sim: Simulator) -> None:
        cfg = sim.cfg
        self.name = name
        self.core = build_region_core(sim_region_assembly(cfg, name, CostSeed(*sim.profile.ttft_seed())))
        # "events": the index the region core fills from KV events, read by the region model's
        # CacheView (one object, as in the balancer daemon)
        self.kv_indexes = self.core.kv_indexes
        self.replica_ids = [f"{name}/r{i}" for i in range(cfg.regions[name])]
        self.core.set_replicas(self.replica_ids, 0.0)
        if self.kv_indexes is not None:
            # the subscriptions are up from the start: every (empty) cache is known
            for rid in self.replica_ids:
                self.core.kv_events(rid, [], 0.0, sim.num_blocks)
        self.seq = 0


@dataclass
class SimResult:
    """Per-request flat arrays (index = order of arrival) and replica counters."""

    arrival: np.ndarray
    ttft: np.ndarray  # NaN: no first token (rejected)
    e2e: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    rejected: np.ndarray
    offloaded: np.ndarray
    # per request: prefix tokens the policy expected to hit (its Decision.matched_tokens)
    # and those the engine served from its cache at first admission; NaN: never admitted
    predicted_cached: np.ndarray
    actual_cached: np.ndarray
    prefix_hit_rate: float
    load_cv: float | None
    load_series: list[tuple[float, list[int]]]  # (t, pending prefill tokens of the plotted replicas)
    plotted_replicas: list[str]
    events: int
    sim_time_s: float
    lazy_mismatches: int
    # per request: the index of its SLO class in ``slo_class_names``; -1: none
    slo_class: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int16))
    slo_class_names: tuple[str, ...] = ()
    slo_class_targets: tuple[SloClassConfig, ...] = ()

    def class_summaries(self, warmup_s: float = 0.0) -> dict[str, dict[str, Any]]:
        """Per SLO class: its requests, attainment (every target it can be judged on met;
        a rejected request misses), share rejected and mean / P90 latencies."""
        return {
            name: class_summary(self.arrival, self.ttft, self.e2e, self.output_len, self.rejected,
                                self.slo_class == k, targets, warmup_s=warmup_s)
            for k, (name, targets) in enumerate(zip(self.slo_class_names, self.slo_class_targets, strict=True))
        }

    def summary(self, slo_s: float, warmup_s: float = 0.0) -> dict[str, Any]:
        return summarize_arrays(self.arrival, self.ttft, self.e2e, self.output_len, self.rejected,
                                self.offloaded, slo_s, prefix_hit_rate=self.prefix_hit_rate,
                                load_cv_value=self.load_cv, warmup_s=warmup_s)

    def prediction_accuracy(self, block_tokens: int, warmup_s: float = 0.0) -> float | None:
        """Share of admitted requests whose predicted cached prefix is within one block
        (``block_tokens``) of the engine's actual one."""
        ok = ~np.isnan(self.actual_cached) & ~np.isnan(self.predicted_cached) & (self.arrival >= warmup_s)
        if not ok.any():
            return None
        diff = np.abs(self.predicted_cached[ok] - self.actual_cached[ok])
        return float(np.mean(diff <= block_tokens))

    def prediction_over(self, block_tokens: int, warmup_s: float = 0.0) -> float | None:
        """Share of admitted requests whose predicted cached prefix exceeds the actual one
        by more than one block (the policy counted on blocks that were not there)."""
        ok = ~np.isnan(self.actual_cached) & ~np.isnan(self.predicted_cached) & (self.arrival >= warmup_s)
        if not ok.any():
            return None
        return round(float(np.mean(self.predicted_cached[ok] - self.actual_cached[ok] > block_tokens)), 4)


class Simulator:
    ARRIVE, STEP_DONE, WAKE, PROBE, HEARTBEAT, BEAT_ARRIVE, FORWARD_ARRIVE, SAMPLE = range(8)

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.profile: Profile = PROFILES[cfg.profile]
        if TRACE_BLOCK_TOKENS % cfg.block_size:
            raise ValueError(f"block_size must divide {TRACE_BLOCK_TOKENS}")
        if cfg.cache_view not in ("history", "events"):
            raise ValueError(f"cache_view must be 'history' or 'events', not {cfg.cache_view!r}")
        self.events_view = cfg.cache_view == "events"
        if self.events_view and cfg.routing.policy.chunk_tokens != cfg.block_size:
            raise ValueError("cache_view 'events' needs chunk_tokens == block_size (the replicas' blocks "
                             "are the balancer's chunks)")
        # keep the profile's KV capacity in tokens whatever the simulated block size
        self.num_blocks = max(1, self.profile.kv_capacity_tokens // cfg.block_size)
        self.regions = {name: _Region(name, self) for name in cfg.regions}
        self.replicas: dict[str, _Replica] = {}
        for reg in self.regions.values():
            for rid in reg.replica_ids:
                eng = Engine(self.profile, block_size=cfg.block_size, num_gpu_blocks=self.num_blocks)
                if self.events_view:
                    eng.enable_kv_events()
                self.replicas[rid] = _Replica(len(self.replicas), rid, reg.name, eng)
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._engine_args: dict[str, tuple[int, list[int], int, list[int] | None]] = {}
        self._engine_req: dict[str, EngineRequest] = {}  # dispatched, first token not yet out
        self._origin: dict[str, str] = {}
        self._served_by: dict[str, str] = {}
        self.now = 0.0
        self.events = 0
        self.lazy_mismatches = 0

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    # ------------------------------------------------------------------ run

    def run(self, trace: Iterable[TraceRequest], progress: Callable[[int], None] | None = None) -> SimResult:
        """Simulate ``trace`` (in arrival order) until every request finished or was rejected."""
        cfg = self.cfg
        max_len = self.profile.max_model_len
        cap = self.num_blocks * cfg.block_size
        default_region = next(iter(self.regions))
        self._arrival = array("d")
        self._first = array("d")
        self._finish = array("d")
        self._in = array("l")
        self._out = array("l")
        self._flags = bytearray()  # 1: rejected, 2: offloaded
        self._predicted = array("d")
        self._actual = array("d")
        class_names = tuple(cfg.slo_classes)
        class_index = {name: k for k, name in enumerate(class_names)}
        self._class = array("h")
        it: Iterator[TraceRequest] = iter(trace)
        self._next_index = 0
        outstanding = 0
        plotted = [rid for reg in self.regions.values() for rid in reg.replica_ids][: cfg.plot_replicas]
        all_ids = list(self.replicas)
        load_series: list[tuple[float, list[int]]] = []
        cvs: list[float] = []

        def pull() -> bool:
            r = next(it, None)
            if r is None:
                return False
            i = self._next_index
            self._next_index += 1
            r = fit_request(r, max_len, cap)
            in_len, out_len = r.input_len, r.output_len
            self._arrival.append(r.arrival_s)
            self._first.append(math.nan)
            self._finish.append(math.nan)
            self._in.append(in_len)
            self._out.append(out_len)
            self._flags.append(0)
            self._predicted.append(math.nan)
            self._actual.append(math.nan)
            self._class.append(class_index.get(r.slo_class, -1))
            region = r.region if r.region in self.regions else default_region
            self._push(r.arrival_s, self.ARRIVE, (i, region, r, in_len, out_len))
            return True

        for name in self.regions:
            self._push(0.0, self.PROBE, name)
            if cfg.offload:
                self._push(0.0, self.HEARTBEAT, name)
        self._push(0.0, self.SAMPLE, None)
        more = pull()
        events = self._events
        pop = heapq.heappop
        while events and (more or outstanding > 0):
            t, _, kind, payload = pop(events)
            self.now = t
            self.events += 1
            if kind == self.STEP_DONE:
                rep, out = payload
                rep.state = _Replica.IDLE
                done = self._apply(rep, out, t)
                outstanding -= done
                if rep.state == _Replica.IDLE:
                    self._kick(rep, t)
                if progress and done:
                    progress(done)
            elif kind == self.WAKE:
                rep, version, t_end = payload
                if version != rep.version or rep.state != _Replica.LAZY:
                    continue
                reached, out = rep.engine.run_until(rep.t_sync, t_end + 1e-9 * max(1.0, t_end))
                if not out.finished or abs(reached - t_end) > 1e-6 * max(1.0, t_end):
                    self.lazy_mismatches += 1
                rep.state = _Replica.IDLE
                done = self._apply(rep, out, t)
                outstanding -= done
                if rep.state == _Replica.IDLE:
                    self._kick(rep, t)
                if progress and done:
                    progress(done)
            elif kind == self.ARRIVE:
                i, region, r, in_len, out_len = payload
                outstanding += 1
                more = pull()
                rid = str(i)
                token_ids: list[int] | None = None
                if self.events_view:
                    prompt_ids = prompt_token_ids(r.hash_ids, in_len, i)
                    blocks, chunks, token_ids = token_chains(prompt_ids, out_len, cfg.block_size)
                else:
                    blocks, chunks = block_chains(r.hash_ids, in_len, cfg.block_size, cfg.routing.policy.chunk_tokens)
                    blocks += output_block_chain(blocks, r.hash_ids, in_len, out_len, cfg.block_size)
                self._engine_args[rid] = (in_len, blocks, out_len, token_ids)
                self._origin[rid] = region
                rreq = RoutingRequest(rid, chunks, in_len, r.arrival_s, max_tokens=out_len,
                                      session_key=str(r.session))
                targets = cfg.slo_classes.get(r.slo_class) if r.slo_class else None
                if targets is not None:
                    apply_slo_class(rreq, SloClass(r.slo_class, targets))
                if not self._admit(self.regions[region], rreq, t):
                    outstanding -= 1
                    if progress:
                        progress(1)
            elif kind == self.PROBE:
                self._probe(self.regions[payload], t)
                self._push(t + cfg.routing.policy.probe_interval_s, self.PROBE, payload)
            elif kind == self.HEARTBEAT:
                self._heartbeat(self.regions[payload], t)
                self._push(t + cfg.routing.offload.heartbeat_interval_s, self.HEARTBEAT, payload)
            elif kind == self.BEAT_ARRIVE:
                dst, src, seq, snapshot = payload
                reg = self.regions[dst]
                reg.core.peer_heartbeat(src, snapshot, t, epoch=1, seq=seq)
                self._dispatch(reg, t)
            elif kind == self.FORWARD_ARRIVE:
                dst, rreq = payload
                if not self._admit(self.regions[dst], rreq, t):
                    outstanding -= 1
                    if progress:
                        progress(1)
            elif kind == self.SAMPLE:
                views = {rid: v for reg in self.regions.values() for rid, v in reg.core.replicas.items()}
                c = cv([views[rid].pending_prefill_tokens for rid in all_ids])
                if c is not None:
                    cvs.append(c)
                load_series.append((t, [views[rid].pending_prefill_tokens for rid in plotted]))
                self._push(t + cfg.sample_load_every_s, self.SAMPLE, None)
        n = self._next_index
        arrival = np.frombuffer(self._arrival, dtype=float)[:n].copy()
        flags = np.frombuffer(bytes(self._flags), dtype=np.uint8)[:n]
        return SimResult(
            arrival=arrival,
            ttft=np.frombuffer(self._first, dtype=float)[:n] - arrival,
            e2e=np.frombuffer(self._finish, dtype=float)[:n] - arrival,
            input_len=np.frombuffer(self._in, dtype=np.int64 if self._in.itemsize == 8 else np.int32)[:n].copy(),
            output_len=np.frombuffer(self._out, dtype=np.int64 if self._out.itemsize == 8 else np.int32)[:n].astype(float),
            rejected=(flags & 1).astype(bool),
            offloaded=(flags & 2).astype(bool),
            predicted_cached=np.frombuffer(self._predicted, dtype=float)[:n].copy(),
            actual_cached=np.frombuffer(self._actual, dtype=float)[:n].copy(),
            prefix_hit_rate=self.prefix_hit_rate(),
            load_cv=sum(cvs) / len(cvs) if cvs else None,
            load_series=load_series,
            plotted_replicas=plotted,
            events=self.events,
            sim_time_s=self.now,
            lazy_mismatches=self.lazy_mismatches,
            slo_class=np.frombuffer(self._class, dtype=np.int16)[:n].copy(),
            slo_class_names=class_names,
            slo_class_targets=tuple(cfg.slo_classes[c] for c in class_names),
        )

    # ------------------------------------------------------------------ balancer side

    def _admit(self, reg: _Region, rreq: RoutingRequest, t: float) -> bool:
        for action in reg.core.submit(rreq, t):
            assert isinstance(action, Reject)
            i = int(rreq.request_id)
            self._flags[i] |= 1
            self._engine_args.pop(rreq.request_id, None)
            self._origin.pop(rreq.request_id, None)
            return False
        self._dispatch(reg, t)
        return True

    def _dispatch(self, reg: _Region, t: float) -> None:
        for action in reg.core.tick(t):
            rid = action.request_id
            if isinstance(action, SendToReplica):
                rep = self.replicas[action.replica_id]
                in_len, blocks, out_len, token_ids = self._engine_args.pop(rid)
                self._served_by[rid] = reg.name
                if reg.name != self._origin[rid]:
                    self._flags[int(rid)] |= 2
                self._predicted[int(rid)] = action.decision.matched_tokens
                self._deliver(rep, rid, in_len, blocks, out_len, token_ids, t)
            elif isinstance(action, ForwardToRegion):
                forwarded = replace(reg.core.request_of(rid), forwarded=True)
                self._push(t + self.cfg.latency_s(reg.name, action.region), self.FORWARD_ARRIVE,
                           (action.region, forwarded))
            else:  # no queue deadline, no failures, no ejections: nothing else can happen here
                raise AssertionError(f"unexpected action in the simulator: {action!r}")

    def _probe(self, reg: _Region, t: float) -> None:
        core, reps = reg.core, self.replicas
        for rid in reg.replica_ids:
            e = reps[rid].engine
            core.probe(rid, ProbeSample(num_running=e.num_running, num_waiting=e.num_waiting,
                                        kv_usage=e.kv_cache_usage), t)
        self._dispatch(reg, t)

    def _heartbeat(self, reg: _Region, t: float) -> None:
        reg.seq += 1
        beat = (reg.name, reg.seq, reg.core.heartbeat(t))
        for other in self.regions:
            if other != reg.name:
                self._push(t + self.cfg.latency_s(reg.name, other), self.BEAT_ARRIVE, (other, *beat))

    # ------------------------------------------------------------------ replica side

    def _deliver(self, rep: _Replica, rid: str, in_len: int, blocks: list[int], out_len: int,
                 token_ids: list[int] | None, t: float) -> None:
        """A request reaches a replica at ``t`` (it joins the engine's next step)."""
        e = rep.engine
        if rep.state == _Replica.LAZY:
            # cut the decode stretch at the step in progress at t; while syncing, nested
            # deliveries (from finishes reported on the way) only queue in the engine
            rep.version += 1
            rep.state = _Replica.STEP
            reached = rep.t_sync
            in_progress: tuple[float, StepOutput] | None = None
            while reached < t:
                nxt, out = e.run_until(reached, t)
                if out.steps == 0:
                    break
                if nxt > t:
                    in_progress = (nxt, out)
                    break
                self._apply(rep, out, nxt)  # a step boundary at or before t
                reached = nxt
            self._add(e, rid, in_len, blocks, out_len, token_ids, t)
            if in_progress is not None:
                self._push(in_progress[0], self.STEP_DONE, (rep, in_progress[1]))
                return
            rep.state = _Replica.IDLE
            self._kick(rep, t)
            return
        self._add(e, rid, in_len, blocks, out_len, token_ids, t)
        if rep.state == _Replica.IDLE:
            self._kick(rep, t)

    def _add(self, e: Engine, rid: str, in_len: int, blocks: list[int], out_len: int,
             token_ids: list[int] | None, t: float) -> None:
        e.add_request(rid, in_len, blocks, out_len, t, token_ids=token_ids)
        self._engine_req[rid] = e.requests[rid]  # its cached prefix is read at its first token

    def _kick(self, rep: _Replica, t: float) -> None:
        """Schedule the replica's next step (or decode stretch) starting at ``t``."""
        e = rep.engine
        if not e.has_work():
            return
        if self.cfg.fuse_decode:
            h = e.decode_horizon()
            if h is not None:
                rep.state = _Replica.LAZY
                rep.t_sync = t
                rep.version += 1
                self._push(t + h, self.WAKE, (rep, rep.version, t + h))
                return
        out = e.step(t)
        if out.steps == 0:
            return
        rep.state = _Replica.STEP
        self._push(t + out.duration_s, self.STEP_DONE, (rep, out))

    def _apply(self, rep: _Replica, out: StepOutput, t: float) -> int:
        """Report a step's first tokens and finishes to the balancers; returns finishes."""
        touched: set[str] = set()
        cfg = self.cfg
        regions = self.regions
        if self.events_view:
            # the step's KV events reach the replica's region core as the step ends (the
            # subscriber is in the same region: no latency), before anything is dispatched
            events = rep.engine.take_kv_events()
            if events:
                regions[rep.region].core.kv_events(rep.rid, routing_events(events), t, self.num_blocks)
        for rid in out.first_token:
            er = self._engine_req.pop(rid, None)
            if er is not None:
                self._actual[int(rid)] = er.cached_tokens
            region = self._served_by[rid]
            origin = self._origin[rid]
            self._first[int(rid)] = t + cfg.latency_s(region, origin)
            regions[region].core.first_token(rid, t)
            if origin != region:
                # the origin tracks its forwarded request to the end too (it books nothing
                # there, so this changes no decision and needs no dispatch round)
                regions[origin].core.first_token(rid, t)
            touched.add(region)
        finished = 0
        for rid in out.finished:
            region = self._served_by.pop(rid)
            origin = self._origin.pop(rid)
            self._finish[int(rid)] = t + cfg.latency_s(region, origin)
            regions[region].core.complete(rid, t)
            if origin != region:
                regions[origin].core.complete(rid, t)
            touched.add(region)
            finished += 1
        for region in touched:
            self._dispatch(self.regions[region], t)
        return finished

    # ------------------------------------------------------------------ summaries

    def prefix_hit_rate(self) -> float:
        q = sum(r.engine.prefix_cache_queries for r in self.replicas.values())
        h = sum(r.engine.prefix_cache_hits for r in self.replicas.values())
        return h / q if q else 0.0
