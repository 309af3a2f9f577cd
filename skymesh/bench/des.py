"""Discrete-event mode: the routing core and the stand-in's engine on a simulated clock.

Every region runs the real :class:`RegionCore` (skymesh/bench/sim_state.py), built by the
one assembly the balancer daemon uses (skymesh/bench/sim_config.py): its policy from the
registry, probes every ``probe_interval_s`` reading the engine's ``num_waiting`` /
``num_running`` / ``kv_cache_usage``, and, with offload on (more than one region), the
offload router fed by heartbeats that take the configured one-way latency to arrive.
Replicas are the real :class:`Engine`. Nothing here reimplements routing or the engine's
scheduling: the simulator (this module, its event loop) only moves time and messages,
submits requests and carries the core's actions out (``SendToReplica``,
``ForwardToRegion``; a ``Reject`` on submission, or at dispatch from a pair rule that
finds no placement meeting a request's targets: there is no queue-wait deadline, no
failure and no ejection in a simulation).

Speed without approximation: while a replica's engine can only decode (nothing in prefill,
no waiting request admissible), the simulator does not step it; it schedules one wake-up
at the end of the step in which the first running request finishes (the engine's own
fused-decode cost). A request dispatched to that replica earlier cuts the stretch: the
engine is advanced (``Engine.run_until``) to the end of the step in progress at that
moment, which is exactly where a real engine would admit it. So the result equals
stepping the engine one iteration at a time, with one event per request phase instead of
one per decode step. Arrivals are pulled lazily from an iterator and per-request results
live in flat arrays (:class:`~skymesh.bench.sim_result.SimResult`), so 1M requests fit in
memory.

What policies read of a replica's cache (``SimConfig.cache_view``): ``"history"`` (the
routing-history trie; chunks and engine blocks hashed from the trace's block ids,
skymesh/bench/sim_chains.py) or ``"events"``: requests get token ids
(:func:`~skymesh.bench.sim_chains.trace_block_ids`), chunks are the balancer's own
:func:`~skymesh.prompt_encoder.id_chunk_hashes` over engine-block-sized chunks, and each
engine's KV events reach its region core's block index at the end of every step.

**The pooled bound** (``SimConfig.pooled``; ``skymesh sim`` system ``NAME@pooled``, or
``--pooled-bound``): every replica of every region forms one pool behind one region core
(:data:`~skymesh.bench.sim_config.POOL`), the real :class:`RegionCore` with the same
policy over all of them, no queue split and no offload (there is no peer); each replica
keeps its region as its *home* (``RegionCore.set_replicas(..., homes=...)``, the
mechanism the daemon uses for replicas adopted on failover) and each client request
carries its region as ``origin_region``. What any cross-region offload could give at
most, short of a better policy: one queue sees every replica at once, with no heartbeat
staleness and no forward decided on a stale view. The link is the simulator's part, as
for a forward: the request reaches its replica the one-way latency between the client's
region and the replica's after the pool placed it, and its first token (and its end)
reach the client the one-way latency back, so a request served in another region pays
the link's round trip, as a forwarded one does, and one served at home pays nothing.

*Residency:* the pool honours the offload rules its config carries (e.g. the EU rule:
``eu-*`` clients only on ``eu-*`` replicas), by the core's own residency check (a replica
whose home the rules close to a request's origin is never offered to the policy for it).
The bound ``skymesh sim`` runs (``NAME@pooled``) carries **no** rule, on purpose: under
the EU rule the pool by the same policy is no bound. Its policy spreads the US and AP
clients over every replica by hash, the EU's included, so at the EU's peak they hold EU
replicas that the EU's clients alone may use, where the mesh sends them to the EU only
when the EU is expected to answer sooner (on the geo day the pool under the EU rule
reaches less goodput than the mesh: docs/benchmarks.md, "The pooled
bound"). A rule only takes placements away, so the free pool is the ceiling for a
mesh under any rules; under a rule the mesh's fraction of it is what the rule and the
mesh together cost.

*Not modelled:* the policy places by its own view and does not price the link
(dualmap's SLO check sees queue and prefill, not the RTT: on the 3-region layout at most
twice the longest one-way link of :data:`~skymesh.bench.sim_setup.GEO3_LATENCY` against
``--slo``), so the bound is this policy's over one pool, not the
best placement there is; and no request is refused for an SLO class that cannot afford
the link, as the mesh's offload refuses to forward it: with SLO classes tighter than a
round trip the pool is no bound. A pooled request served away from its client's region
counts as offloaded (``SimResult.offloaded``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from skymesh.bench.scores import cv
from skymesh.bench.sim_chains import (
    block_chains,
    output_block_chain,
    prompt_token_ids,
    token_chains,
)
from skymesh.bench.sim_config import POOL, SimConfig, pool_homes
from skymesh.bench.sim_result import SimResult
from skymesh.bench.sim_state import SimRegion, SimReplica, routing_events
from skymesh.bench.traces import TraceRequest, fit_request
from skymesh.bench.verdict import VerdictWatch
from skymesh.hardware import PROFILES, Profile
from skymesh.replica_sim.engine import Engine
from skymesh.replica_sim.request_state import EngineRequest
from skymesh.replica_sim.scheduler import StepOutput
from skymesh.routing.assembly import CostSeed
from skymesh.routing.base import RoutingRequest
from skymesh.routing.health import ProbeSample
from skymesh.routing.region_actions import ForwardToRegion, Reject, SendToReplica
from skymesh.slo_judge import SloClass, apply_slo_class
from skymesh.word_tokenizer import TRACE_BLOCK_TOKENS


def _nothing() -> None:
    """A change of nothing: :meth:`Simulator._at` only brings the engine up to the time."""


class Simulator:
    (ARRIVE, STEP_DONE, WAKE, PROBE, HEARTBEAT, BEAT_ARRIVE, FORWARD_ARRIVE, SAMPLE, SIBLING,
     SIBLING_ARRIVE, DELIVER, KV_MOVED) = range(12)

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
        if cfg.pair_rule == "never" and any(p or d for p, d in cfg.pd_split.values()):
            raise ValueError("prefill-only or decode-only replicas need a pair rule (pair_rule)")
        # keep the profile's KV capacity in tokens whatever the simulated block size
        self.num_blocks = max(1, self.profile.kv_capacity_tokens // cfg.block_size)
        seed = CostSeed(*self.profile.ttft_seed())
        # the simulated region cores: one per region, or the pooled bound's one
        self.pool: SimRegion | None = None
        if cfg.pooled:
            self.pool = SimRegion(POOL, cfg, seed, self.num_blocks, homes=pool_homes(cfg))
            self.regions = {POOL: self.pool}
        else:
            self.regions = {name: SimRegion(name, cfg, seed, self.num_blocks) for name in cfg.regions}
        self.replicas: dict[str, SimReplica] = {}
        # replica -> the simulated region whose cores drive it (its own region but in the pool)
        self._owner: dict[str, SimRegion] = {}
        for reg in self.regions.values():
            for rid in reg.replica_ids:
                eng = Engine(self.profile, block_size=cfg.block_size, num_gpu_blocks=self.num_blocks)
                if self.events_view:
                    eng.enable_kv_events()
                eng.record_step_durations = cfg.record_tbt
                self.replicas[rid] = SimReplica(len(self.replicas), rid, reg.homes[rid], eng)
                self._owner[rid] = reg
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._engine_args: dict[str, tuple[int, list[int], int, list[int] | None]] = {}
        self._engine_req: dict[str, EngineRequest] = {}  # dispatched, first token not yet out
        # request -> (region core, balancer index) it arrived at, and its client's region
        self._origin: dict[str, tuple[str, int, str]] = {}
        # request -> (region core, balancer index) it is served by
        self._served_by: dict[str, tuple[str, int]] = {}
        self.max_replica_waiting = 0
        self.max_replica_unadmitted = 0
        # a pair rule prices decode legs by the replicas' running batch and KV use: a
        # probe of a lazily stepped replica brings it up to the probe's time first (its
        # finishers and blocks as a single-stepped engine shows them), which no policy needs
        self._exact_probes = cfg.pair_rule != "never"
        # split requests (skymesh/routing/pairing): those whose prefill leg runs now, by
        # their prefill replica; and what their decode leg is sent with
        self._prefill_leg: dict[str, SimReplica] = {}
        self._decode_leg: dict[str, tuple[SimReplica, int, list[int], int, list[int] | None]] = {}
        # token intervals per request while it streams (cfg.record_tbt): its last token's
        # time and its longest intervals so far (a min-heap of at most a tenth of them)
        self._last_token: dict[str, float] = {}
        self._longest: dict[str, list[float]] = {}
        self.now = 0.0
        self.events = 0
        self.lazy_mismatches = 0

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    # ------------------------------------------------------------------ run

    def run(self, trace: Iterable[TraceRequest], progress: Callable[[int], None] | None = None,
            watch: VerdictWatch | None = None) -> SimResult:
        """Simulate ``trace`` (in arrival order) until every request finished or was
        rejected, or, with ``watch`` (built for this trace's requests in order), until the
        run's SLO verdict is decided (``SimResult.stopped_early`` says why)."""
        cfg = self.cfg
        max_len = self.profile.max_model_len
        cap = self.num_blocks * cfg.block_size
        default_region = next(iter(cfg.regions))
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
        # per request: its client's region and the region of the replica that served it
        # (indices into cfg.regions; -1: not served)
        region_index = {name: k for k, name in enumerate(cfg.regions)}
        self._client = array("h")
        self._served_in = array("h")
        self._region_index = region_index
        self._tbt = array("d")
        self._split = bytearray()
        it: Iterator[TraceRequest] = iter(trace)
        self._next_index = 0
        outstanding = 0
        # requests a pair rule refused at dispatch (each was outstanding; _dispatch counts them)
        self._refused_at_dispatch = 0
        self._progress = progress
        if watch is not None and watch.tbt_slo_s is not None and not self.cfg.record_tbt:
            raise ValueError("a watch with a TBT target needs the run to record TBT (SimConfig.record_tbt)")
        self._watch = watch
        self._stop = watch is not None and watch.decided
        self._overdue_at = 0  # requests before this index were swept for an overdue first token
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
            region = r.region if r.region in cfg.regions else default_region
            self._client.append(region_index[region])
            self._served_in.append(-1)
            self._tbt.append(math.nan)
            self._split.append(0)
            self._push(r.arrival_s, self.ARRIVE, (i, region, r, in_len, out_len))
            return True

        probe_s = cfg.routing.policy.probe_interval_s
        sibling_s = cfg.routing.siblings.interval_s
        for name, reg in self.regions.items():
            n = len(reg.cores)
            for k in range(n):
                # balancers are not in step with each other: spread their rounds
                self._push(k * probe_s / n, self.PROBE, (name, k))
                if cfg.offload:
                    self._push(0.0, self.HEARTBEAT, (name, k))
                if n > 1:
                    self._push(k * sibling_s / n, self.SIBLING, (name, k))
        self._push(0.0, self.SAMPLE, None)
        more = pull()
        events = self._events
        pop = heapq.heappop
        while events and (more or outstanding > self._refused_at_dispatch) and not self._stop:
            t, _, kind, payload = pop(events)
            self.now = t
            self.events += 1
            if kind == self.STEP_DONE:
                rep, out = payload
                rep.state = SimReplica.IDLE
                done = self._apply(rep, out, t)
                outstanding -= done
                if rep.state == SimReplica.IDLE:
                    self._kick(rep, t)
                if progress and done:
                    progress(done)
            elif kind == self.WAKE:
                rep, version, t_end = payload
                if version != rep.version or rep.state != SimReplica.LAZY:
                    continue
                reached, out = rep.engine.run_until(rep.t_sync, t_end + 1e-9 * max(1.0, t_end))
                if not out.finished or abs(reached - t_end) > 1e-6 * max(1.0, t_end):
                    self.lazy_mismatches += 1
                rep.state = SimReplica.IDLE
                done = self._apply(rep, out, t)
                outstanding -= done
                if rep.state == SimReplica.IDLE:
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
                # the pool: one core for every client, each request carrying its region
                reg = self.pool if self.pool is not None else self.regions[region]
                k = reg.next_balancer()
                self._origin[rid] = (reg.name, k, region)
                rreq = RoutingRequest(rid, chunks, in_len, r.arrival_s, max_tokens=out_len,
                                      session_key=str(r.session),
                                      origin_region=region if self.pool is not None else None)
                targets = cfg.slo_classes.get(r.slo_class) if r.slo_class else None
                if targets is not None:
                    apply_slo_class(rreq, SloClass(r.slo_class, targets))
                if not self._admit(reg, k, rreq, t):
                    outstanding -= 1
                    if progress:
                        progress(1)
            elif kind == self.PROBE:
                name, k = payload
                self._probe(self.regions[name], k, t)
                self._push(t + cfg.routing.policy.probe_interval_s, self.PROBE, payload)
            elif kind == self.HEARTBEAT:
                name, k = payload
                self._heartbeat(self.regions[name], k, t)
                self._push(t + cfg.routing.offload.heartbeat_interval_s, self.HEARTBEAT, payload)
            elif kind == self.BEAT_ARRIVE:
                dst, dk, src, seq, snapshot = payload
                reg = self.regions[dst]
                reg.cores[dk].peer_heartbeat(src, snapshot, t, epoch=1, seq=seq)
                self._dispatch(reg, dk, t)
            elif kind == self.SIBLING:
                name, k = payload
                reg = self.regions[name]
                msg = reg.cores[k].sibling_message(t)
                for other in range(len(reg.cores)):
                    if other != k:
                        self._push(t + cfg.sibling_delay_s, self.SIBLING_ARRIVE, (name, other, msg))
                self._push(t + cfg.routing.siblings.interval_s, self.SIBLING, payload)
            elif kind == self.SIBLING_ARRIVE:
                name, k, msg = payload
                reg = self.regions[name]
                core = reg.cores[k]
                if core.sibling_state(msg, t) and core.siblings is not None and core.siblings.units_grew:
                    self._dispatch(reg, k, t)
            elif kind == self.FORWARD_ARRIVE:
                dst, rreq = payload
                reg = self.regions[dst]
                k = reg.next_balancer()
                if not self._admit(reg, k, rreq, t):
                    outstanding -= 1
                    if progress:
                        progress(1)
            elif kind == self.DELIVER:
                self._deliver(*payload, t)
            elif kind == self.KV_MOVED:
                self._kv_moved(payload, t)
            elif kind == self.SAMPLE:
                if self._watch is not None:
                    self._sweep_overdue(t)
                pending = {rid: 0 for rid in all_ids}
                for reg in self.regions.values():
                    for core in reg.cores:
                        for rid, v in core.view.replicas.items():
                            pending[rid] += v.pending_prefill_tokens
                c = cv([pending[rid] for rid in all_ids])
                if c is not None:
                    cvs.append(c)
                load_series.append((t, [pending[rid] for rid in plotted]))
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
            max_replica_waiting=self.max_replica_waiting,
            max_replica_unadmitted=self.max_replica_unadmitted,
            region_names=tuple(cfg.regions),
            client_region=np.frombuffer(self._client, dtype=np.int16)[:n].copy(),
            served_region=np.frombuffer(self._served_in, dtype=np.int16)[:n].copy(),
            tbt=np.frombuffer(self._tbt, dtype=float)[:n].copy(),
            split=np.frombuffer(bytes(self._split), dtype=np.uint8)[:n].astype(bool),
            stopped_early=watch.reason if watch is not None and self._stop else "",
        )

    # ------------------------------------------------------------------ balancer side

    def _admit(self, reg: SimRegion, k: int, rreq: RoutingRequest, t: float) -> bool:
        """``rreq`` reaches balancer ``k`` of ``reg`` (the one it stays with)."""
        for action in reg.cores[k].submit(rreq, t):
            assert isinstance(action, Reject)
            self._rejected(rreq.request_id)
            return False
        self._dispatch(reg, k, t)
        return True

    def _sweep_overdue(self, t: float) -> None:
        """Requests that arrived more than the watch's TTFT target before ``t`` and have
        no first token yet: theirs comes at ``t`` or later, so each is a certain miss
        (counted now, not when an overloaded queue finally serves it)."""
        watch = self._watch
        assert watch is not None
        slo, first, arrival, n = watch.slo_s, self._first, self._arrival, self._next_index
        i = self._overdue_at
        while i < n and arrival[i] + slo < t:
            if first[i] != first[i] and watch.overdue(i):  # NaN: none yet
                self._stop = True
            i += 1
        self._overdue_at = i

    def _rejected(self, rid: str) -> None:
        self._flags[int(rid)] |= 1
        if self._watch is not None and self._watch.rejected(int(rid)):
            self._stop = True
        self._engine_args.pop(rid, None)
        self._origin.pop(rid, None)

    def _dispatch(self, reg: SimRegion, k: int, t: float) -> None:
        core = reg.cores[k]
        for action in core.tick(t):
            rid = action.request_id
            if isinstance(action, SendToReplica):
                rep = self.replicas[action.replica_id]
                in_len, blocks, out_len, token_ids = self._engine_args.pop(rid)
                self._served_by[rid] = (reg.name, k)
                client = self._origin[rid][2]
                if rep.region != client:
                    self._flags[int(rid)] |= 2
                self._served_in[int(rid)] = self._region_index[rep.region]
                self._predicted[int(rid)] = action.decision.matched_tokens
                # a region's balancer is next to its replicas; the pool's prompt travels
                # from the client's region to the replica's (a forward paid it on the way)
                delay = self.cfg.latency_s(client, rep.region) if self.pool is not None else 0.0
                decode = action.decision.decode_replica_id
                if decode is not None:
                    # split: a prefill leg of one output token whose blocks stay held, then
                    # the decode leg (skymesh/routing/pairing)
                    self._split[int(rid)] = 1
                    self._prefill_leg[rid] = rep
                    self._decode_leg[rid] = (self.replicas[decode], in_len, blocks, out_len, token_ids)
                    out_len = 1
                if delay > 0.0:
                    self._push(t + delay, self.DELIVER, (rep, rid, in_len, blocks, out_len, token_ids))
                else:
                    self._deliver(rep, rid, in_len, blocks, out_len, token_ids, t)
            elif isinstance(action, ForwardToRegion):
                # as the daemon's forward claims it (request_flow.peer_target): the sender's region
                forwarded = replace(core.view.request_of(rid), forwarded=True, origin_region=reg.name)
                self._push(t + self.cfg.latency_s(reg.name, action.region), self.FORWARD_ARRIVE,
                           (action.region, forwarded))
            elif isinstance(action, Reject) and action.code == "slo_unreachable":
                # a pair rule's refusal (skymesh/routing/pairing/conductor.py)
                self._rejected(rid)
                self._refused_at_dispatch += 1
                if self._progress:
                    self._progress(1)
            else:  # no queue deadline, no failures, no ejections: nothing else can happen here
                raise AssertionError(f"unexpected action in the simulator: {action!r}")

    def _probe(self, reg: SimRegion, k: int, t: float) -> None:
        core, reps = reg.cores[k], self.replicas
        for rid in reg.replica_ids:
            e = reps[rid].engine
            waiting = e.num_waiting
            if waiting > self.max_replica_waiting:
                self.max_replica_waiting = waiting
            if waiting and e.num_waiting_never_admitted > self.max_replica_unadmitted:
                self.max_replica_unadmitted = e.num_waiting_never_admitted
            if self._exact_probes and reps[rid].state == SimReplica.LAZY:
                self._at(reps[rid], t, _nothing)
                waiting = e.num_waiting  # brought up to the probe's time
            core.probe(rid, ProbeSample(num_running=e.num_running, num_waiting=waiting,
                                        kv_usage=e.kv_cache_usage, sent_at=t), t)
        self._dispatch(reg, k, t)

    def _heartbeat(self, reg: SimRegion, k: int, t: float) -> None:
        """Balancer ``k`` of ``reg`` heartbeats the balancer its connection reaches in each
        peer region (the one of the same index: regions run as many each)."""
        reg.seq[k] += 1
        beat = (reg.name, reg.seq[k], reg.cores[k].view.heartbeat(t))
        for other, oreg in self.regions.items():
            if other != reg.name:
                self._push(t + self.cfg.latency_s(reg.name, other), self.BEAT_ARRIVE,
                           (other, k % len(oreg.cores), *beat))

    # ------------------------------------------------------------------ replica side

    def _deliver(self, rep: SimReplica, rid: str, in_len: int, blocks: list[int], out_len: int,
                 token_ids: list[int] | None, t: float, external_tokens: int = 0) -> None:
        """A request reaches a replica at ``t`` (it joins the engine's next step)."""
        self._at(rep, t, lambda: self._add(rep.engine, rid, in_len, blocks, out_len, token_ids, t,
                                           external_tokens, rid in self._prefill_leg))

    def _kv_moved(self, rid: str, t: float) -> None:
        """A split request's KV reached its decode replica: the prefill replica's held
        blocks are released and the decode leg joins the decode replica's engine."""
        prefill = self._prefill_leg.pop(rid)
        self._at(prefill, t, lambda: prefill.engine.release_held(rid))
        rep, in_len, blocks, out_len, token_ids = self._decode_leg.pop(rid)
        self._deliver(rep, rid, in_len, blocks, out_len, token_ids, t, external_tokens=in_len)

    def _at(self, rep: SimReplica, t: float, change: Callable[[], object]) -> None:
        """Change ``rep``'s engine at ``t`` (a request joins, held blocks are freed): a
        fused decode stretch in progress is cut at the step in progress at ``t``, which is
        where a real engine would see the change."""
        e = rep.engine
        if rep.state == SimReplica.LAZY:
            # cut the decode stretch at the step in progress at t; while syncing, nested
            # deliveries (from finishes reported on the way) only queue in the engine
            rep.version += 1
            rep.state = SimReplica.STEP
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
            change()
            if in_progress is not None:
                self._push(in_progress[0], self.STEP_DONE, (rep, in_progress[1]))
                return
            rep.state = SimReplica.IDLE
            self._kick(rep, t)
            return
        change()
        if rep.state == SimReplica.IDLE:
            self._kick(rep, t)

    def _add(self, e: Engine, rid: str, in_len: int, blocks: list[int], out_len: int,
             token_ids: list[int] | None, t: float, external_tokens: int = 0, hold_blocks: bool = False) -> None:
        e.add_request(rid, in_len, blocks, out_len, t, token_ids=token_ids, external_tokens=external_tokens,
                      hold_blocks=hold_blocks)
        if not external_tokens:  # its cached prefix is read at its (prefill's) first token
            self._engine_req[rid] = e.requests[rid]

    def _kick(self, rep: SimReplica, t: float) -> None:
        """Schedule the replica's next step (or decode stretch) starting at ``t``."""
        e = rep.engine
        if not e.has_work():
            return
        if self.cfg.fuse_decode:
            h = e.decode_horizon()
            if h is not None:
                rep.state = SimReplica.LAZY
                rep.t_sync = t
                rep.version += 1
                self._push(t + h, self.WAKE, (rep, rep.version, t + h))
                return
        out = e.step(t)
        if out.steps == 0:
            return
        rep.state = SimReplica.STEP
        self._push(t + out.duration_s, self.STEP_DONE, (rep, out))

    def _apply(self, rep: SimReplica, out: StepOutput, t: float) -> int:
        """Report a step's first tokens and finishes to the balancers; returns finishes."""
        # the balancers to run a dispatch round for, in the order the step reached them: a
        # dict, not a set, whose order would follow the strings' hashes (PYTHONHASHSEED)
        # wherever a step touches two balancers of one region
        touched: dict[tuple[str, int], None] = {}
        cfg = self.cfg
        regions = self.regions
        if self.events_view:
            # the step's KV events reach the replica's region core as the step ends (the
            # subscriber is in the same region: no latency), before anything is dispatched
            events = rep.engine.take_kv_events()
            if events:
                decoded = routing_events(events)
                for core in self._owner[rep.rid].cores:  # every balancer consumes every event
                    core.kv_events(rep.rid, decoded, t, self.num_blocks)
        prefill_legs = self._prefill_leg
        if cfg.record_tbt:
            self._note_intervals(out, t)
        for rid in out.first_token:
            er = self._engine_req.pop(rid, None)
            if er is not None:
                self._actual[int(rid)] = er.cached_tokens
            if rid in prefill_legs:
                continue  # a prefill leg's token is not the client's
            region, k = self._served_by[rid]
            origin, ok, client = self._origin[rid]
            # back to the client over the link from the replica's region
            i = int(rid)
            self._first[i] = t + cfg.latency_s(rep.region, client)
            if self._watch is not None and self._watch.first_token(i, self._first[i] - self._arrival[i]):
                self._stop = True
            regions[region].cores[k].first_token(rid, t)
            if origin != region:
                # the origin tracks its forwarded request to the end too (it books nothing
                # there, so this changes no decision and needs no dispatch round)
                regions[origin].cores[ok].first_token(rid, t)
            touched[region, k] = None
        finished = 0
        for rid in out.finished:
            if rid in prefill_legs:
                # its prefill leg answered: the decode leg's replica pulls the KV it lacks
                region, k = self._served_by[rid]
                decode = regions[region].cores[k].prefill_done(rid, t)
                drep, in_len, blocks, _, _ = self._decode_leg[rid]
                assert decode == drep.rid, (decode, drep.rid)
                # what the decode replica holds now (a lazily stepped one brought up to t)
                self._at(drep, t, _nothing)
                lacking = in_len - drep.engine.cached_prefix_tokens(blocks, in_len)
                moved = max(0, lacking) * self.profile.kv_bytes_per_token
                self._push(t + cfg.kv_links.transfer_s(rep.rid, drep.rid, moved), self.KV_MOVED, rid)
                touched[region, k] = None
                continue
            if cfg.record_tbt:
                self._tbt[int(rid)] = self._tbt_of(rid)
                if self._watch is not None and self._watch.finished(int(rid), self._tbt[int(rid)]):
                    self._stop = True
            region, k = self._served_by.pop(rid)
            origin, ok, client = self._origin.pop(rid)
            self._finish[int(rid)] = t + cfg.latency_s(rep.region, client)
            regions[region].cores[k].complete(rid, t)
            if origin != region:
                regions[origin].cores[ok].complete(rid, t)
            touched[region, k] = None
            finished += 1
        for region, k in touched:
            self._dispatch(self.regions[region], k, t)
        return finished

    def _note_intervals(self, out: StepOutput, t: float) -> None:
        """Each client token's interval since the request's last one, keeping its longest
        tenth (a fused stretch's steps lengthen as the context grows: its longest are its
        last ones)."""
        last, longest, durations = self._last_token, self._longest, out.step_durations
        for rid, n in out.tokens:
            if rid in self._prefill_leg:
                continue
            before = last.get(rid)
            last[rid] = t
            if before is None:  # its first token
                longest[rid] = []
                continue
            top = longest[rid]
            keep = max(1, math.ceil(0.1 * (self._out[int(rid)] - 1)))
            gaps = (t - before,) if n == 1 or durations is None else durations[-min(n, keep):]
            for gap in gaps:
                if len(top) < keep:
                    heapq.heappush(top, gap)
                elif gap > top[0]:
                    heapq.heapreplace(top, gap)

    def _tbt_of(self, rid: str) -> float:
        """A finished request's TBT: the mean of its longest tenth of token intervals."""
        self._last_token.pop(rid, None)
        top = self._longest.pop(rid, None)
        return sum(top) / len(top) if top else 0.0

    # ------------------------------------------------------------------ summaries

    def prefix_hit_rate(self) -> float:
        q = sum(r.engine.prefix_cache_queries for r in self.replicas.values())
        h = sum(r.engine.prefix_cache_hits for r in self.replicas.values())
        return h / q if q else 0.0
