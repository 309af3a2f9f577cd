"""`skymesh sim --trace FILE --systems a,b,c --out DIR`: the discrete-event benchmark.

Every system runs on the same replicas, the same trace and the same seed, at every rate
multiplier of ``--rates`` (the goodput sweep). A system name is a policy from the registry
(``dualmap``, ``prefix_tree``, ...). With one region that is a single central balancer in
front of all replicas; with several regions every region has its own balancer and
``NAME`` offloads across regions (skymesh; ``--offload-trigger``), ``NAME@saturated`` by
SkyWalker's rule, while ``NAME@local`` never does (region-local). ``NAME@pooled`` is the
pooled bound (skymesh/bench/des.py): every replica of every region behind one region core
running ``NAME``, each client paying the link to the replica's region, with no residency
rule whatever the run's (a bound: skymesh/bench/des.py says why); ``--pooled-bound`` adds
it for every policy of ``--systems`` and reports each system's goodput as a fraction of
its policy's bound.

``--config FILE`` simulates the operator's own mesh instead of ``--regions``: its regions
in order, their one-way latencies, replica counts and ``sim.profile``, its ``policy``,
``queue`` and ``offload`` sections (residency rules, trigger, min_gain_s, ...), as the
daemon reads them (:func:`apply_config` says which options the command line still sets).

``--trace`` is a Mooncake JSONL file or a synthetic workload: ``hot-prefix`` (tool/agent
traffic on a few popular system prompts), ``tot2`` / ``tot4`` (Tree-of-Thoughts with
branching 2 / 4), ``synthetic`` (a lazy stream of multi-turn conversations, ``--requests``
of them at ``--rate`` req/s over all regions: the large-scale run).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from skymesh.bench.day_shape import day_shape
from skymesh.bench.report import markdown_table, write_report
from skymesh.bench.scores import goodput
from skymesh.bench.search_main import run_search
from skymesh.bench.sim_setup import (
    add_arguments,
    build_trace,
    check_policy_options,
    chunk_tokens,
    mesh_of,
    of_pooled,
    parse_policy_options,
    pooled_of,
    replicas_per_region,
    run_one,
    systems_of,
)
from skymesh.bench.traces import fit_to_context, oracle_hit_rate
from skymesh.hardware import PROFILES
from skymesh.runtime.procs import quiet_pool_worker

# the `skymesh sim` command (skymesh/cli.py): its options are the shared ones (sim_setup.py)
__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    mesh = mesh_of(args)  # with --config: the file loaded and checked before anything runs
    if args.goodput_search:
        return run_search(args)
    from tqdm import tqdm

    systems = systems_of(args)
    check_policy_options(systems, parse_policy_options(args.policy_option))
    rates = [float(x) for x in args.rates.split(",")]
    jobs = [(s, r) for s in systems for r in rates]
    out = Path(args.out)
    results: dict[tuple[str, float], dict[str, Any]] = {}
    t_start = time.perf_counter()
    if args.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(max_workers=args.jobs, initializer=quiet_pool_worker) as pool:
            futs = {pool.submit(run_one, args, s, r, False): (s, r) for s, r in jobs}
            with tqdm(total=len(jobs), desc="simulations", unit="run") as bar:
                from concurrent.futures import as_completed

                for f in as_completed(futs):
                    results[futs[f]] = f.result()
                    bar.update(1)
    else:
        for s, r in jobs:
            results[(s, r)] = run_one(args, s, r, True)
    summaries: dict[str, dict[str, Any]] = {}
    sweeps: dict[str, list[dict[str, Any]]] = {}
    ttfts: dict[str, list[float]] = {}
    for s in systems:
        sweeps[s] = [results[(s, r)]["metrics"] for r in rates]
        first = sweeps[s][0]
        summaries[s] = {**first, "goodput": round(goodput([(p["rate"], p["slo_attainment"]) for p in sweeps[s]]), 4)}
        ttfts[s] = results[(s, rates[0])]["ttfts"]
    base = build_trace(args)
    # on the requests as replayed (cut to the replica's context), as the live mode reports it
    prof = PROFILES[args.profile]
    oracle = (oracle_hit_rate(fit_to_context(base, prof.max_model_len, prof.kv_capacity_tokens))
              if isinstance(base, list) else None)
    first_run = results[(systems[0], rates[0])]
    names = list(mesh.names)
    config = {"mode": "discrete-event", "trace": args.trace, "requests": first_run["metrics"]["requests"],
              "config": mesh.config, "residency": mesh.residency(),
              "regions": names, "replicas_per_region": replicas_per_region(args, names), "profile": args.profile,
              "slo_s": args.slo, "rates": rates, "skew": args.skew,
              **(day_shape(args, len(names)).describe() if len(names) > 1 else {}),
              "block_size": args.block_size, "cache_view": args.cache_view,
              "chunk_tokens": chunk_tokens(args), "warmup_s": args.warmup_s, "seed": args.seed,
              "oracle_prefix_hit_rate": None if oracle is None else round(oracle, 4),
              "wall_s_total": round(time.perf_counter() - t_start, 1)}
    write_report(out, summaries, config, sweeps, ttfts, first_run["load"], systems[0],
                 first_run["load_replicas"])
    print(markdown_table(summaries))
    for s, r in jobs:
        for name, c in results[(s, r)]["metrics"].get("classes", {}).items():
            print(f"{s} x{r:g} class {name}: requests={c['requests']} attainment={c['slo_attainment']} "
                  f"rejected={c['rejected_share']} ttft_mean={c['ttft_mean']} e2e_mean={c['e2e_mean']}")
    for s, r in jobs:
        for name, reg in results[(s, r)]["metrics"].get("regions", {}).items():
            print(f"{s} x{r:g} region {name}: requests={reg['requests']} attainment={reg['slo_attainment']} "
                  f"offloaded={reg['offloaded_share']} ttft_p90={reg['ttft_p90']}")
    for s, frac in of_pooled({s: [summaries[s]["goodput"]] for s in systems}).items():
        print(f"{s}: goodput {frac[0]:.3f} of the pooled bound's ({pooled_of(s)})" if frac[0] is not None
              else f"{s}: the pooled bound's goodput is 0")
    if oracle is not None:
        print(f"\noracle (infinite shared cache) prefix hit rate: {oracle:.4f}")
    print("wall time per run (s): " + ", ".join(f"{s}@x{r:g}={results[(s, r)]['metrics']['wall_s']} (cpu {results[(s, r)]['metrics']['cpu_s']})"
                                                for s, r in jobs))
    print(f"wrote {out}/results.json, results.md, ttft_cdf.png, goodput_vs_rate.png, replica_load.png")
    return 0
