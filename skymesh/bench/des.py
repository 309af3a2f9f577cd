"""Discrete-event mode: the routing core and the stand-in's engine on a simulated clock.

Every region runs the real :class:`BalancerCore` (selective pushing, probes every
``probe_interval_s``) with a policy from the registry, and — with offload on — the real
:class:`OffloadRouter` fed by heartbeats that take the configured one-way latency to
arrive. Replicas are the real :class:`Engine`. Nothing here reimplements routing: the
simulator only moves time and messages.

Accuracy knob: a replica in pure decode advances in fused chunks of at most
``max_fuse_s`` (default 20 ms); a request dispatched meanwhile joins at the chunk end.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from skymesh.bench.traces import TraceRequest
from skymesh.replica_sim.engine import Engine
from skymesh.replica_sim.profiles import PROFILES, Profile
from skymesh.routing.base import PolicyContext, RoutingRequest
from skymesh.routing.dispatcher import BalancerCore, QueueFull
from skymesh.routing.offload import OffloadRouter
from skymesh.routing.registry import make_policy
from skymesh.tokens import TRACE_BLOCK_TOKENS


@dataclass
class SimConfig:
    policy: str = "dualmap"
    regions: dict[str, int] = field(default_factory=lambda: {"r0": 16})  # region -> replicas
    one_way_ms: dict[tuple[str, str], float] = field(default_factory=dict)
    profile: str = "h100-qwen2.5-7b"
    ttft_slo_s: float = 2.0
    offload: bool = True
    allowed: Callable[[str, str], bool] = lambda s, d: True
    probe_interval_s: float = 0.1
    heartbeat_interval_s: float = 0.1
    max_remote_queue: int = 4
    chunk_tokens: int = TRACE_BLOCK_TOKENS
    block_size: int = 16
    queue_bound: int = 100_000
    dispatch_budget: int = 2
    trie_max_nodes: int = 200_000
    max_fuse_s: float = 0.02
    sample_load_every_s: float = 1.0
    policy_options: dict[str, Any] = field(default_factory=dict)

    def latency_s(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        return self.one_way_ms.get((a, b), self.one_way_ms.get((b, a), 0.0)) / 1000.0


@dataclass(slots=True)
class RequestResult:
    arrival_s: float
    input_len: int
    output_len: int
    origin: str
    served_region: str = ""
    replica: str = ""
    first_token_s: float | None = None
    finish_s: float | None = None
    rejected: bool = False
    offloaded: bool = False

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


class _Replica:
    __slots__ = ("rid", "region", "engine", "busy")

    def __init__(self, rid: str, region: str, engine: Engine) -> None:
        self.rid, self.region, self.engine, self.busy = rid, region, engine, False


class _Region:
    def __init__(self, name: str, sim: Simulator) -> None:
        cfg = sim.cfg
        self.name = name
        prof = sim.profile
        per_tok = (prof.prefill_time_s(1024) - prof.prefill_time_s(512)) / 512
        ctx = PolicyContext(
            chunk_tokens=cfg.chunk_tokens, ttft_slo_s=cfg.ttft_slo_s, trie_max_nodes=cfg.trie_max_nodes,
            prefill_s_per_token=per_tok, prefill_fixed_s=max(0.0, prof.prefill_time_s(512) - per_tok * 512),
            options=cfg.policy_options,
        )
        self.core = BalancerCore(make_policy(cfg.policy, ctx), queue_bound=cfg.queue_bound,
                                 dispatch_budget=cfg.dispatch_budget)
        self.replicas = [f"{name}/r{i}" for i in range(cfg.regions[name])]
        self.core.set_replicas(self.replicas)
        rtt = {o: 2 * cfg.latency_s(name, o) for o in cfg.regions if o != name}
        self.offload = OffloadRouter(name, rtt, allowed=cfg.allowed, max_remote_queue=cfg.max_remote_queue,
                                     heartbeat_interval_s=cfg.heartbeat_interval_s, miss_limit=3,
                                     enabled=cfg.offload and len(cfg.regions) > 1)
        self.seq = 0


_MASK = 0xFFFF_FFFF_FFFF_FFFF


def _chains(hash_ids: Sequence[int], input_len: int, block_size: int, chunk_tokens: int) -> tuple[list[int], tuple[int, ...]]:
    """Engine block hashes (full blocks) and routing chunk hashes, from trace block ids,
    chained so that equal hash-id prefixes give equal chains."""
    per_block = TRACE_BLOCK_TOKENS // block_size
    blocks: list[int] = []
    prev = 0
    full_blocks = input_len // block_size
    for h in hash_ids:
        for j in range(per_block):
            if len(blocks) >= full_blocks:
                break
            prev = hash((prev, h, j)) & _MASK
            blocks.append(prev)
    chunks: list[int] = []
    prev = 0
    per_chunk = max(1, TRACE_BLOCK_TOKENS // chunk_tokens)
    n_chunks = -(-input_len // chunk_tokens)
    for h in hash_ids:
        for j in range(per_chunk):
            if len(chunks) >= n_chunks:
                break
            prev = hash((prev, h, j, 1)) & _MASK
            chunks.append(prev)
    return blocks, tuple(chunks)


class Simulator:
    ARRIVE, STEP_DONE, PROBE, HEARTBEAT, BEAT_ARRIVE, FORWARD_ARRIVE, SAMPLE = range(7)

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.profile: Profile = PROFILES[cfg.profile]
        self.regions = {name: _Region(name, self) for name in cfg.regions}
        self.replicas: dict[str, _Replica] = {}
        for reg in self.regions.values():
            for rid in reg.replicas:
                self.replicas[rid] = _Replica(rid, reg.name, Engine(self.profile, block_size=cfg.block_size))
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.results: dict[str, RequestResult] = {}
        self._engine_args: dict[str, tuple[int, list[int], int]] = {}
        self._served_by: dict[str, str] = {}  # request id -> region whose core placed it
        self.load_samples: list[tuple[float, dict[str, int]]] = []
        self.now = 0.0

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    # ------------------------------------------------------------------ run

    def run(self, trace: Sequence[TraceRequest], progress: Callable[[int], None] | None = None) -> dict[str, RequestResult]:
        cfg = self.cfg
        max_len = self.profile.max_model_len
        default_region = next(iter(self.regions))
        for i, r in enumerate(trace):
            out_len = max(1, r.output_len)
            in_len = max(1, min(r.input_len, max_len - out_len, self.profile.num_gpu_blocks * cfg.block_size // 2))
            rid = f"q{i}"
            region = r.region if r.region in self.regions else default_region
            self.results[rid] = RequestResult(r.arrival_s, in_len, out_len, region)
            blocks, chunks = _chains(r.hash_ids, in_len, cfg.block_size, cfg.chunk_tokens)
            self._engine_args[rid] = (in_len, blocks, out_len)
            rreq = RoutingRequest(rid, chunks, in_len, r.arrival_s, max_tokens=out_len,
                                  session_key=str(r.session))
            self._push(r.arrival_s, self.ARRIVE, (region, rreq))
        for name in self.regions:
            self._push(0.0, self.PROBE, name)
            if len(self.regions) > 1 and cfg.offload:
                self._push(0.0, self.HEARTBEAT, name)
        self._push(0.0, self.SAMPLE, None)
        outstanding = len(trace)
        done = 0
        while self._events and outstanding > 0:
            t, _, kind, payload = heapq.heappop(self._events)
            self.now = t
            if kind == self.ARRIVE:
                region, rreq = payload
                self._admit(self.regions[region], rreq, t)
            elif kind == self.STEP_DONE:
                finished = self._step_done(payload, t)
                outstanding -= finished
                done += finished
                if progress and finished:
                    progress(finished)
            elif kind == self.PROBE:
                self._probe(self.regions[payload], t)
                self._push(t + cfg.probe_interval_s, self.PROBE, payload)
            elif kind == self.HEARTBEAT:
                self._heartbeat(self.regions[payload], t)
                self._push(t + cfg.heartbeat_interval_s, self.HEARTBEAT, payload)
            elif kind == self.BEAT_ARRIVE:
                dst, src, fields = payload
                reg = self.regions[dst]
                reg.offload.update_peer(src, now=t, **fields)
                self._dispatch(reg, t)
            elif kind == self.FORWARD_ARRIVE:
                dst, rreq = payload
                self._admit(self.regions[dst], rreq, t)
            elif kind == self.SAMPLE:
                self.load_samples.append((t, {rid: v.pending_prefill_tokens
                                              for reg in self.regions.values()
                                              for rid, v in reg.core.replicas.items()}))
                self._push(t + cfg.sample_load_every_s, self.SAMPLE, None)
            outstanding_rejects = self._drain_rejects()
            outstanding -= outstanding_rejects
            if progress and outstanding_rejects:
                progress(outstanding_rejects)
        return self.results

    _rejects = 0

    def _drain_rejects(self) -> int:
        n, self._rejects = self._rejects, 0
        return n

    # ------------------------------------------------------------------ balancer side

    def _admit(self, reg: _Region, rreq: RoutingRequest, t: float) -> None:
        try:
            reg.core.submit(rreq)
        except QueueFull:
            self.results[rreq.request_id].rejected = True
            self._rejects += 1
            return
        self._dispatch(reg, t)

    def _dispatch(self, reg: _Region, t: float) -> None:
        for rreq, decision in reg.core.dispatch(t):
            rid = rreq.request_id
            rep = self.replicas[decision.replica_id]  # type: ignore[index]
            in_len, blocks, out_len = self._engine_args[rid]
            rep.engine.add_request(rid, in_len, blocks, out_len, t)
            self._served_by[rid] = reg.name
            res = self.results[rid]
            res.replica = rep.rid
            res.served_region = reg.name
            if not rep.busy:
                self._start_step(rep, t)
        if reg.core.queue_length and not reg.core.any_available() and reg.offload.enabled:
            chosen = []
            for rreq in reg.core.queued_requests():
                if rreq.forwarded:
                    continue
                target = reg.offload.choose(rreq, t)
                if target is None:
                    if not reg.offload.candidates(t):
                        break
                    continue
                reg.offload.on_forwarded(rreq, target, t)
                chosen.append((rreq, target))
            reg.core.take_for_offload(r.request_id for r, _ in chosen)
            for rreq, target in chosen:
                rreq.forwarded = True
                self.results[rreq.request_id].offloaded = True
                self._push(t + self.cfg.latency_s(reg.name, target), self.FORWARD_ARRIVE, (target, rreq))

    def _probe(self, reg: _Region, t: float) -> None:
        for rid in reg.replicas:
            e = self.replicas[rid].engine
            reg.core.update_replica(rid, healthy=True, num_running=e.num_running, num_waiting=e.num_waiting,
                                    kv_usage=e.kv_cache_usage)
        self._dispatch(reg, t)

    def _heartbeat(self, reg: _Region, t: float) -> None:
        reg.seq += 1
        fields = {"epoch": 1, "seq": reg.seq, "replicas_total": len(reg.replicas),
                  "replicas_available": reg.core.available_count(), "queue_length": reg.core.queue_length,
                  "pending_prefill_tokens": reg.core.pending_prefill_tokens()}
        for other in self.regions:
            if other != reg.name:
                self._push(t + self.cfg.latency_s(reg.name, other), self.BEAT_ARRIVE, (other, reg.name, fields))

    # ------------------------------------------------------------------ replica side

    def _start_step(self, rep: _Replica, t: float) -> None:
        if not rep.engine.has_work():
            rep.busy = False
            return
        t_end, out = rep.engine.run_until(t, t + self.cfg.max_fuse_s)
        if out.steps == 0:
            rep.busy = False
            return
        rep.busy = True
        self._push(t_end, self.STEP_DONE, (rep, out))

    def _step_done(self, payload: tuple[_Replica, Any], t: float) -> int:
        rep, out = payload
        touched: set[str] = set()
        for rid in out.first_token:
            res = self.results[rid]
            region = self._served_by[rid]
            back = self.cfg.latency_s(region, res.origin)
            res.first_token_s = t + back
            self.regions[region].core.on_first_token(rid, t)
            touched.add(region)
        finished = 0
        for rid in out.finished:
            res = self.results[rid]
            region = self._served_by[rid]
            res.finish_s = t + self.cfg.latency_s(region, res.origin)
            self.regions[region].core.on_complete(rid, True, t)
            touched.add(region)
            finished += 1
        self._start_step(rep, t)
        for region in touched:
            self._dispatch(self.regions[region], t)
        return finished

    # ------------------------------------------------------------------ summaries

    def prefix_hit_rate(self) -> float:
        q = sum(r.engine.prefix_cache_queries for r in self.replicas.values())
        h = sum(r.engine.prefix_cache_hits for r in self.replicas.values())
        return h / q if q else 0.0
