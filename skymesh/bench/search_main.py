"""`skymesh sim --goodput-search`: goodput by bisection per system and workload variant.

Every (system, variant) pair is one bisection (:func:`skymesh.bench.ranking.bisect_goodput`)
whose evaluations are discrete-event runs at rate multipliers of the variant's trace; pairs
run in parallel (``--jobs``). A variant is an arrival seed (``--seeds``; synthetic
workloads draw their prompts and arrivals from it, traces their region assignment) and a
trace window (``--windows``). The report gives each system's goodput (req/s) per variant,
mean and spread, the prefix hit rate and P90 TTFT at its goodput, the workload's bounds
(infinite-cache oracle and the realistic shared-LRU bound), and the rankings that hold on
every variant. With ``--pooled-bound`` (or a ``NAME@pooled`` system) each system's goodput
is also given per variant as a fraction of its policy's pooled bound (skymesh/bench/des.py,
"The pooled bound").
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from skymesh.bench.ranking import Spread, bisect_goodput, ranking_statements
from skymesh.bench.sim_setup import (
    build_trace,
    check_policy_options,
    mesh_of,
    of_pooled,
    parse_policy_options,
    replicas_per_region,
    run_one,
    systems_of,
)
from skymesh.bench.traces import fit_to_context, lru_hit_rate, oracle_hit_rate
from skymesh.hardware import PROFILES
from skymesh.runtime.procs import quiet_pool_worker

# the attainment a rate must reach to count in the goodput (skymesh/bench/ranking.py)
GOODPUT_TARGET = 0.9


def variants(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The workload variants: seeds × windows, as overrides of ``args``."""
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    if args.windows:
        windows = []
        for item in args.windows.split(","):
            start, sep, duration = item.partition(":")
            if not sep:
                raise SystemExit(f"--windows {item!r}: expected START:DURATION")
            windows.append((float(start), float(duration)))
    else:
        windows = [(args.start_s, args.duration_s)]
    return [{"seed": sd, "start_s": st, "duration_s": du} for sd in seeds for st, du in windows]


def variant_name(v: dict[str, Any]) -> str:
    w = f" window {v['start_s']:g}+{v['duration_s']:g}s" if v["duration_s"] else ""
    return f"seed {v['seed']}{w}"


def with_variant(args: argparse.Namespace, v: dict[str, Any]) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **v})


def base_rate(args: argparse.Namespace) -> float | None:
    """Arrivals per second of the variant's trace at multiplier 1 (None for the lazy
    synthetic stream, whose base rate is ``--rate``)."""
    trace = build_trace(args)
    if not isinstance(trace, list):
        return float(args.rate)
    if len(trace) < 2:
        return None
    span = trace[-1].arrival_s - trace[0].arrival_s
    return len(trace) / span if span > 0 else None


def search_one(args: argparse.Namespace, system: str, v: dict[str, Any]) -> dict[str, Any]:
    """One bisection (picklable: runs in a worker process)."""
    a = with_variant(args, v)
    by_rate: dict[float, dict[str, Any]] = {}

    # a rate's run stops once it is certain to miss the bisection's target: only its
    # verdict matters (a rate that passes runs whole: the goodput's figures are exact)
    stop_below = None if args.no_early_stop else GOODPUT_TARGET

    def attainment_at(rate: float) -> float:
        m = run_one(a, system, rate, False, stop_below)["metrics"]
        by_rate[rate] = m
        return float(m["slo_attainment"])

    s = bisect_goodput(attainment_at, target=GOODPUT_TARGET, resolution=args.resolution)
    at = by_rate.get(s.goodput, {})
    return {"system": system, "variant": v, "goodput_multiplier": s.goodput, "bracket": s.bracket,
            "evaluated": s.evaluated, "prefix_hit_rate": at.get("prefix_hit_rate"), "ttft_p90": at.get("ttft_p90"),
            # over every rate tried: the most requests pushed to a replica and not admitted yet
            "max_replica_unadmitted": max((m.get("max_replica_unadmitted", 0) for m in by_rate.values()), default=0),
            "wall_s": round(sum(m["wall_s"] for m in by_rate.values()), 1)}


def bounds(args: argparse.Namespace) -> dict[str, float | None]:
    """Hit-rate bounds of the variant's workload as replayed (cut to the replica's context)."""
    trace = build_trace(args)
    if not isinstance(trace, list):
        return {"oracle": None, "lru": None}
    prof = PROFILES[args.profile]
    reqs = fit_to_context(trace, prof.max_model_len, prof.kv_capacity_tokens)
    names = list(mesh_of(args).names)
    capacity = prof.kv_capacity_tokens * sum(replicas_per_region(args, names).values())
    return {"oracle": round(oracle_hit_rate(reqs), 4), "lru": round(lru_hit_rate(reqs, capacity), 4)}


def run_search(args: argparse.Namespace) -> int:
    systems = systems_of(args)
    check_policy_options(systems, parse_policy_options(args.policy_option))
    vs = variants(args)
    t0 = time.perf_counter()
    jobs = [(s, i) for s in systems for i in range(len(vs))]
    results: dict[tuple[str, int], dict[str, Any]] = {}
    if args.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(max_workers=args.jobs, initializer=quiet_pool_worker) as pool:
            futs = {pool.submit(search_one, args, s, vs[i]): (s, i) for s, i in jobs}
            for f in as_completed(futs):
                results[futs[f]] = f.result()
                r = results[futs[f]]
                print(f"{r['system']} {variant_name(r['variant'])}: x{r['goodput_multiplier']:.3f} "
                      f"({len(r['evaluated'])} runs, {r['wall_s']} s)", flush=True)
    else:
        for s, i in jobs:
            results[(s, i)] = search_one(args, s, vs[i])
    rates = [base_rate(with_variant(args, v)) for v in vs]
    bound = [bounds(with_variant(args, v)) for v in vs]
    goodputs: dict[str, list[float]] = {}
    rows = []
    for s in systems:
        per = [results[(s, i)] for i in range(len(vs))]
        g = [r["goodput_multiplier"] * (rates[i] or 1.0) for i, r in enumerate(per)]
        goodputs[s] = g
        rows.append({"system": s, "goodput": g, "hit_rate": [r["prefix_hit_rate"] for r in per],
                     "ttft_p90": [r["ttft_p90"] for r in per], "searches": per})
    claims = ranking_statements(goodputs, args.resolution)
    # each system as a fraction of its policy's pooled bound, where the run has one
    fractions = of_pooled(goodputs)
    for row in rows:
        if row["system"] in fractions:
            row["of_pooled"] = fractions[row["system"]]
    pooled_col = bool(fractions)
    unit = "req/s" if all(r is not None for r in rates) else "x the trace's rate"
    lines = [f"variants: {', '.join(variant_name(v) for v in vs)}; resolution {args.resolution:.0%}; "
             f"SLO attainment >= 0.9 at TTFT {args.slo:g} s",
             "", f"| system | goodput ({unit}) per variant | mean | spread (min-max) | prefix hit rate at goodput | "
             "P90 TTFT at goodput (s) |" + (" × pooled bound per variant |" if pooled_col else ""),
             "|---|---|---|---|---|---|" + ("---|" if pooled_col else "")]

    def each(vals: list[Any]) -> str:
        return " / ".join("-" if x is None else f"{x:.3g}" for x in vals)
    for row in rows:
        sp = Spread(tuple(row["goodput"]))
        frac = (f" {each(row['of_pooled'])} |" if "of_pooled" in row else " |") if pooled_col else ""
        lines.append(f"| {row['system']} | {each(row['goodput'])} | {sp.mean:.3g} | {sp.low:.3g}-{sp.high:.3g} | "
                     f"{each(row['hit_rate'])} | {each(row['ttft_p90'])} |{frac}")
    blank = " |" if pooled_col else ""
    lines.append(f"| oracle (infinite shared cache) | | | | {' / '.join(str(b['oracle']) for b in bound)} | |{blank}")
    lines.append(f"| realistic bound (shared LRU of all KV) | | | | {' / '.join(str(b['lru']) for b in bound)} | |"
                 f"{blank}")
    lines += ["", "Rankings (a claim only where every variant agrees beyond the resolution):"]
    lines += [f"- {c}" for c in claims]
    report = "\n".join(lines)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "search.json").write_text(json.dumps({
        "config": {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool | type(None))},
        "variants": vs, "base_rates": rates, "bounds": bound, "rows": rows, "rankings": claims,
        "wall_s_total": round(time.perf_counter() - t0, 1)}, indent=1))
    (out / "search.md").write_text(report + "\n")
    print(report)
    print(f"wrote {out}/search.json, search.md ({time.perf_counter() - t0:.0f} s)")
    return 0
