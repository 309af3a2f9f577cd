"""`skymesh bench --trace FILE --systems a,b,c --out DIR`: live trace replay.

For every system, fresh stand-in replica processes (same profile, same count, same time
scale) are started, then the router under test (:mod:`skymesh.bench.peers`): a skymesh
balancer with policy NAME (any registry name; one central balancer owning every replica)
or a real peer router (``sglang-router``, ``vllm-router``; skipped with a message when not
installed). The trace's first ``--requests`` requests are replayed open loop by
:mod:`skymesh.bench.loadgen` (on time, never waiting for answers, every response
streamed), then the replicas' prefix-cache counters are read from their /metrics.

Time scale: the replicas run ``--time-scale`` times their profile's step times and the
trace is replayed ``1 / time-scale`` times faster, so the load ratio is the trace's and the
TTFT SLO is scaled by the same factor.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from skymesh.bench import figures
from skymesh.bench.classes import add_class_arguments, slo_classes, with_slo_mix
from skymesh.bench.day_shape import DayShape, add_day_arguments, day_shape
from skymesh.bench.loadgen import LiveResult, LoadSampler, prefix_hit_rate, replay
from skymesh.bench.peers import INSTALL_HINT, PEERS, peer_available, router_child
from skymesh.bench.report import markdown_table, write_report
from skymesh.bench.scores import class_summary, monotone_goodput, summarize
from skymesh.bench.trace_args import trace_argument
from skymesh.bench.traces import (
    DEFAULT_TRACE,
    TraceRequest,
    fit_to_context,
    load_mooncake,
    oracle_hit_rate,
    scale_rate,
)
from skymesh.config import SloClassConfig
from skymesh.hardware import PROFILES
from skymesh.runtime.procs import Child, free_port, start_sim_replicas, wait_healthy

Samples = list[tuple[float, dict[str, int]]]
Outcome = tuple[dict[str, Any], list[LiveResult], Samples]


def _metrics(results: list[LiveResult], args: argparse.Namespace, hit: float | None,
             samples: Samples) -> dict[str, Any]:
    slo = args.slo * args.time_scale
    m = summarize(results, slo, hit, load_samples=(snap for _, snap in samples),
                  warmup_s=args.warmup_s * args.time_scale)
    m["slo_s_scaled"] = slo
    m["max_send_lateness_s"] = round(max((r.late_s for r in results), default=0.0), 4)
    m["replicas_used"] = len({r.replica for r in results if r.replica})
    classes = scaled_slo_classes(args)
    if classes:
        m["classes"] = live_class_summaries(results, classes, args.warmup_s * args.time_scale)
    if args.regions > 1:
        # lazy, as in run(): `skymesh bench` imports every mode's module for its parser
        from skymesh.bench.live_geo import geo_regions

        m["regions"] = live_region_summaries(results, geo_regions(), slo, args.warmup_s * args.time_scale)
    return m


def live_region_summaries(results: list[LiveResult], regions: list[str], slo_s: float,
                          warmup_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Per client region (a request's ``origin``): the metric set of its own requests
    (attainment, TTFT, share offloaded, ...), as the discrete-event mode's
    ``SimResult.region_summaries`` gives it."""
    return {name: summarize([r for r in results if r.origin == name], slo_s, warmup_s=warmup_s)
            for name in regions}


def region_lines(m: dict[str, Any]) -> list[str]:
    """One printed line per client region of a run's metrics (none without regions)."""
    return [f"  {name}: requests={r['requests']} slo_attainment={r['slo_attainment']} "
            f"offloaded_share={r['offloaded_share']} ttft_p90={r['ttft_p90']}"
            for name, r in m.get("regions", {}).items()]


def scaled_slo_classes(args: argparse.Namespace) -> dict[str, SloClassConfig]:
    """``--slo-classes`` with every target scaled by the time scale, as the TTFT SLO is."""
    ts = args.time_scale
    return {
        name: c.model_copy(update={k: None if getattr(c, k) is None else getattr(c, k) * ts
                                   for k in ("ttft_s", "tpot_s", "e2e_s")})
        for name, c in slo_classes(args).items()
    }


def live_class_summaries(results: list[LiveResult], classes: dict[str, SloClassConfig],
                         warmup_s: float) -> dict[str, dict[str, Any]]:
    """Per class, the figures of :func:`class_summary`, judged at the client (output
    tokens counted from the stream's events)."""
    def arr(vals: list[float | None]) -> np.ndarray:
        return np.array([math.nan if v is None else v for v in vals], dtype=float)

    arrival = arr([r.arrival_s for r in results])
    ttft, e2e = arr([r.ttft for r in results]), arr([r.e2e for r in results])
    tokens = np.array([r.tokens for r in results], dtype=float)
    rejected = np.array([r.rejected for r in results])
    names = np.array([r.slo_class for r in results])
    return {name: class_summary(arrival, ttft, e2e, tokens, rejected, names == name, targets, warmup_s=warmup_s)
            for name, targets in classes.items()}


async def run_geo_system(system: str, trace: list[TraceRequest], args: argparse.Namespace,
                         tmp: Path) -> Outcome | None:
    from tqdm import tqdm

    # lazy: `skymesh bench` imports every mode's module for its parser; only a run loads the simulator
    from skymesh.bench.live_geo import run_mesh_system

    if system in PEERS:
        print(f"skipping {system}: the peer routers have no multi-region mode", file=sys.stderr)
        return None
    with tqdm(total=len(trace), desc=system, unit="req", leave=False, mininterval=1.0) as bar:
        results, hit, samples, max_waiting = await run_mesh_system(system, trace, args, tmp,
                                                                   on_done=lambda: bar.update(1))
    return {**_metrics(results, args, hit, samples), "max_replica_waiting": max_waiting}, results, samples


async def run_system(system: str, trace: list[TraceRequest], args: argparse.Namespace,
                     tmp: Path) -> Outcome | None:
    from tqdm import tqdm

    if args.regions > 1:
        return await run_geo_system(system, trace, args, tmp)
    if system in PEERS and not peer_available(system):
        print(f"skipping {system}: not installed ({INSTALL_HINT})", file=sys.stderr)
        return None
    children: list[Child] = []
    slo = args.slo * args.time_scale
    # the balancer child inherits it; the load sampler sends it to /admin/status
    os.environ.setdefault("SKYMESH_ADMIN_TOKEN", secrets.token_urlsafe(32))
    try:
        reps, urls = await start_sim_replicas(args.replicas, args.profile, args.time_scale, tmp,
                                              f"{system}-replica")
        children.extend(reps)
        # a skymesh balancer binds port 0 and reports it; a peer router cannot report, so
        # it gets a picked port and is polled
        port = 0 if system not in PEERS else free_port()
        classes = {name: c.model_dump(exclude_none=True) for name, c in scaled_slo_classes(args).items()}
        # the queue's bounds are seconds of the trace's time, scaled as the SLO is
        queue = {"discipline": args.queue_discipline, "max_age_s": args.queue_max_age_s * args.time_scale,
                 "prefix_ttft_share": args.prefix_ttft_share}
        router = router_child(system, urls, port, tmp, slo, classes, not args.no_early_rejection, queue)
        if router is None:
            print(f"skipping {system}: not installed ({INSTALL_HINT})", file=sys.stderr)
            return None
        router.start()
        children.append(router)
        if system in PEERS:
            url = f"http://127.0.0.1:{port}"
            await wait_healthy(url + "/health", router, within_s=60)
        else:
            url = f"http://127.0.0.1:{(await router.wait_ready(60))['http']}"
        status = [] if system in PEERS else [url + "/admin/status"]
        with tqdm(total=len(trace), desc=system, unit="req", leave=False, mininterval=1.0) as bar:
            async with LoadSampler(status, args.load_sample_s * args.time_scale, args.time_scale) as sampler:
                results = await replay(trace, lambda _r: url, args.timeout_s, on_done=lambda: bar.update(1))
        hit = await prefix_hit_rate(urls)
        return _metrics(results, args, hit, sampler.samples), results, sampler.samples
    finally:
        for c in reversed(children):
            await c.stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    # no default here: argparse would check the default trace even for --replot, which
    # reads none (run() checks it, as argparse would, when a run needs it)
    p.add_argument("--trace", default=None, type=trace_argument(p.prog),
                   help="Mooncake JSONL trace (default: the Mooncake conversation trace in ../shared/traces/, "
                        "not part of the repository)")
    p.add_argument("--systems", default="dualmap,prefix_tree,cache_aware,round_robin,sglang-router,vllm-router")
    p.add_argument("--out", default="bench-out/live")
    p.add_argument("--requests", type=int, default=300, help="first N trace requests (the load bound)")
    p.add_argument("--rates", default="1", help="comma-separated rate multipliers (the goodput sweep)")
    p.add_argument("--time-scale", type=float, default=0.05, help="replica speed-up (the SLO scales with it)")
    p.add_argument("--replicas", type=int, default=8, help="stand-ins (per region with --regions 3)")
    p.add_argument("--region-replicas", default=None, metavar="NAME=N,...",
                   help="3 regions: replicas of named regions (the others keep --replicas), e.g. eu-west-1=4 "
                        "(as skymesh sim's; a skymesh plan layout)")
    p.add_argument("--profile", default="h100-qwen2.5-7b")
    p.add_argument("--slo", type=float, default=2.0, help="TTFT SLO in seconds at time scale 1")
    p.add_argument("--warmup-s", type=float, default=0.0, help="exclude the first S trace seconds")
    p.add_argument("--timeout-s", type=float, default=300.0, help="wall-clock bound per run")
    p.add_argument("--regions", type=int, default=1, choices=(1, 3),
                   help="1: one central router; 3: the local 3-region mesh (NAME offloads, NAME@local does not)")
    # 3 regions: the day's shape, in the local default's region order (us-east-1 first)
    add_day_arguments(p, first_region="us-east-1")
    p.add_argument("--no-eu-rule", action="store_true", help="3 regions: let eu-* regions offload anywhere")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--balancers-per-region", type=int, default=1,
                   help="3 regions: active-active balancers per region behind its entry (balancer.siblings)")
    add_class_arguments(p)
    p.add_argument("--load-sample-s", type=float, default=1.0,
                   help="trace seconds between samples of the balancers' per-replica load")
    p.add_argument("--png", default=None, metavar="PATH",
                   help="also draw the results page's figure (attainment per rate, goodput per system) to PATH")
    p.add_argument("--replot", default=None, metavar="RESULTS_JSON",
                   help="run nothing: draw --png from a results.json this command wrote earlier")


def run(args: argparse.Namespace) -> int:
    if args.replot:
        if not args.png:
            raise SystemExit("--replot: name the figure's file with --png PATH")
        print(f"wrote {figures.peers_figure(figures.load_json(args.replot), Path(args.png))}")
        return 0
    if args.trace is None:
        args.trace = trace_argument("skymesh bench")(DEFAULT_TRACE)
    profile = PROFILES[args.profile]
    # the same cut the discrete-event mode makes, so both replay the same work
    base = fit_to_context(load_mooncake(args.trace, args.requests), profile.max_model_len,
                          profile.kv_capacity_tokens)
    shape: DayShape | None = None
    layout: dict[str, int] | None = None
    if args.regions > 1:
        # lazy: `skymesh bench` imports every mode's module for its parser; only a run loads the simulator
        from skymesh.bench.live_geo import geo_layout, geo_regions, geo_trace

        shape = day_shape(args, len(geo_regions()))
        layout = geo_layout(args)  # checked before any mesh starts
        base = geo_trace(base, shape, args.seed)
        if args.slo_classes:
            raise SystemExit("--slo-classes: the 3-region live mode does not configure classes on its mesh yet")
    elif args.region_replicas:
        raise SystemExit("--region-replicas: only with --regions 3")
    base = with_slo_mix(base, args)
    rates = [float(x) for x in args.rates.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="skymesh-live-"))
    systems: dict[str, dict[str, Any]] = {}
    sweeps: dict[str, list[dict[str, Any]]] = {}
    ttfts: dict[str, list[float]] = {}
    load_plot: tuple[str, Samples] | None = None  # the first system's load at the first rate
    t_start = time.perf_counter()
    try:
        for system in [s for s in args.systems.split(",") if s]:
            pts = []
            for rate in rates:
                # compress time together with the replicas so the load ratio is the trace's
                trace = scale_rate(base, rate / args.time_scale)
                got = asyncio.run(run_system(system, trace, args, tmp))
                if got is None:
                    break
                m, results, samples = got
                span = max(1e-9, trace[-1].arrival_s - trace[0].arrival_s) / args.time_scale
                m["rate"] = round(len(trace) / span, 4)  # in trace-time req/s
                m["rate_multiplier"] = rate
                pts.append(m)
                if rate == rates[0]:
                    ttfts[system] = [r.ttft / args.time_scale for r in results if r.ttft is not None]
                    if load_plot is None and samples:
                        load_plot = (system, samples)
                print(f"{system} x{rate:g}: slo_attainment={m['slo_attainment']} ttft_p50={m['ttft_p50']}"
                      + "".join("\n" + line for line in region_lines(m)), flush=True)
            if pts:
                sweeps[system] = pts
                systems[system] = {**pts[0], "goodput": round(monotone_goodput([(p["rate"], p["slo_attainment"])
                                                                       for p in pts]), 4)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    config = {"mode": "live", "trace": args.trace, "requests": len(base), "replicas": args.replicas,
              "regions": args.regions, **({"replicas_per_region": layout} if layout is not None else {}),
              "skew": args.skew,
              **(shape.describe() if shape is not None else {}), "profile": args.profile, "time_scale": args.time_scale, "rates": rates, "slo_s": args.slo,
              "slo_s_scaled": args.slo * args.time_scale, "oracle_prefix_hit_rate": round(oracle_hit_rate(base), 4),
              "wall_s_total": round(time.perf_counter() - t_start, 1),
              "note": "ttft_* and e2e_* are wall-clock seconds at the time scale; the CDF plot is in trace time"}
    plot_system, series, replica_ids = "", None, []
    if load_plot is not None:
        plot_system, samples = load_plot
        replica_ids = sorted({rid for _, snap in samples for rid in snap})[:32]
        series = [(t, [snap.get(rid, 0) for rid in replica_ids]) for t, snap in samples]
    write_report(Path(args.out), systems, config | {"slo_s": args.slo}, sweeps, ttfts, series, plot_system,
                 replica_ids)
    print(markdown_table(systems))
    if args.png:
        print(f"wrote {figures.peers_figure(figures.load_json(Path(args.out) / 'results.json'), Path(args.png))}")
    return 0
