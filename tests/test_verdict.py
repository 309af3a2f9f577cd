"""Stopping a simulated day once its SLO verdict is decided (skymesh/bench/verdict.py):
on random small days, the stopped run's verdict per region is the full run's, a run that
passes is never stopped in the mesh mode, and a plain overload stops early."""

from __future__ import annotations

import random

import numpy as np

from skymesh.bench.des import Simulator
from skymesh.bench.scores import summarize_arrays
from skymesh.bench.sim_config import SimConfig
from skymesh.bench.traces import TraceRequest
from skymesh.bench.verdict import StopWhen, VerdictWatch, attainment
from skymesh.bench.workloads import synthetic_conversations

REGIONS = ("a", "b", "c")


def day(rng: random.Random) -> tuple[SimConfig, list[TraceRequest], float, float, float]:
    replicas = {r: rng.randint(1, 3) for r in REGIONS}
    n = rng.randint(150, 400)
    rate = rng.uniform(20.0, 300.0)
    trace = list(synthetic_conversations(n, REGIONS, rate, skew=rng.uniform(0.0, 0.8), think_s=5.0,
                                         seed=rng.randrange(1 << 30)))
    cfg = SimConfig(regions=replicas)
    slo = rng.choice((0.2, 0.5, 1.0))
    target = rng.choice((0.5, 0.8, 0.9, 0.99))
    warmup = rng.choice((0.0, 0.5))
    return cfg, trace, slo, target, warmup


def watch_for(trace: list[TraceRequest], slo: float, target: float, warmup: float, when: StopWhen) -> VerdictWatch:
    return VerdictWatch.for_requests(REGIONS, [r.arrival_s for r in trace], [r.region for r in trace], slo_s=slo,
                                     target=target, when=when, warmup_s=warmup)


def full_verdicts(cfg: SimConfig, trace: list[TraceRequest], slo: float, target: float,
                  warmup: float) -> dict[str, bool]:
    res = Simulator(cfg).run(trace)
    assert not res.stopped_early
    return {name: s["slo_attainment"] >= target for name, s in res.region_summaries(slo, warmup).items()}


def test_a_stopped_run_gives_the_full_runs_verdict_per_region() -> None:
    seen = {"stopped": 0, "ran to the end": 0, "a region passed": 0, "a region failed": 0}
    for seed in range(12):
        rng = random.Random(seed)
        cfg, trace, slo, target, warmup = day(rng)
        full = full_verdicts(cfg, trace, slo, target, warmup)
        seen["a region passed"] += any(full.values())
        seen["a region failed"] += not all(full.values())

        every = watch_for(trace, slo, target, warmup, StopWhen.EVERY_REGION_DECIDED)
        Simulator(cfg).run(trace, watch=every)
        for k, name in enumerate(REGIONS):
            assert every.verdict(k) is full[name], (seed, name, every.bounds(), full)

        mesh = watch_for(trace, slo, target, warmup, StopWhen.ANY_REGION_FAILS)
        res = Simulator(cfg).run(trace, watch=mesh)
        seen["stopped" if res.stopped_early else "ran to the end"] += 1
        if all(full.values()):
            assert not res.stopped_early, seed  # a passing day runs to its end: its figures are exact
        else:
            assert mesh.decided and res.stopped_early == mesh.reason, seed
            failed = [name for k, name in enumerate(REGIONS) if mesh.verdict(k) is False]
            assert failed and all(not full[name] for name in failed), seed
    # the random days reach every outcome
    assert all(n > 0 for n in seen.values()), seen


def test_an_overloaded_day_stops_early_and_says_why() -> None:
    trace = list(synthetic_conversations(3000, REGIONS, 60.0, think_s=5.0, seed=7))
    cfg = SimConfig(regions=dict.fromkeys(REGIONS, 1))
    watch = watch_for(trace, 1.0, 0.9, 0.0, StopWhen.ANY_REGION_FAILS)
    res = Simulator(cfg).run(trace, watch=watch)
    assert res.stopped_early and "attainment at most" in res.stopped_early
    # it stopped well before the day's end: most requests never arrived
    assert res.arrival.size < len(trace) // 2
    failing = [k for k in range(len(REGIONS)) if watch.verdict(k) is False]
    assert failing and all(watch.upper(k) < 0.9 for k in failing)


def test_the_bounds_are_the_scores_attainment() -> None:
    # the watch's count, by hand, against summarize_arrays on the same outcomes
    rng = np.random.default_rng(3)
    arrival = np.sort(rng.uniform(0, 100, 500))
    region = rng.choice(list(REGIONS), 500)
    ttft = rng.exponential(1.0, 500)
    rejected = rng.random(500) < 0.05
    ttft[rejected] = np.nan
    watch = VerdictWatch.for_requests(REGIONS, arrival.tolist(), region.tolist(), slo_s=1.0, target=2.0,
                                      when=StopWhen.EVERY_REGION_DECIDED, warmup_s=10.0)
    for i in range(500):
        if rejected[i]:
            watch.rejected(i)
        else:
            watch.first_token(i, float(ttft[i]))
    for k, name in enumerate(REGIONS):
        sel = region == name
        s = summarize_arrays(arrival[sel], ttft[sel], ttft[sel], np.ones(sel.sum()), rejected[sel],
                             np.zeros(sel.sum(), dtype=bool), 1.0, warmup_s=10.0)
        # every outcome settled: both bounds are the attainment
        assert watch.lower(k) == watch.upper(k) == s["slo_attainment"]
        assert watch.total[k] == s["requests"]
    assert attainment(0, 0) == 0.0
