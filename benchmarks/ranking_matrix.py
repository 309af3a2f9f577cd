"""The policy matrix (issue "Routing that wins"): every cache-aware policy's goodput by
bisection (``skymesh sim --goodput-search``, skymesh/bench/ranking.py) on several
workloads, each on several variants (arrival seeds or trace windows), with the spread,
the prefix hit rate and P90 TTFT at each system's goodput, the infinite-cache oracle, the
realistic bound (one shared LRU of all KV) and the rankings every variant agrees on.

    .venv/bin/python -m benchmarks.ranking_matrix [--workloads conversation,hot-prefix,tot2,kv-constrained]
        [--systems dualmap,dualmap-nowait,prefix_tree,preble,min_ttft,cache_aware] [--jobs 2]
        [--out bench-out/ranking_matrix.json]

A system name is a policy (``dualmap`` with its defaults, which wait for a faster busy
candidate), or ``dualmap-nowait`` (dualmap with ``wait_for_faster_candidate=false``:
plain selective pushing, the default before the matrix was run); ``NAME/DISCIPLINE`` runs
it behind that queue discipline (``dualmap/prefix``: FEATHER's order; ``/slo``). Every (workload, system, variant) search runs in a
process pool; the same variant gives every system the same requests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skymesh.bench import sim_setup  # noqa: E402
from skymesh.bench.ranking import Spread, ranking_statements  # noqa: E402
from skymesh.bench.search_main import base_rate, bounds, search_one, variants, with_variant  # noqa: E402

WORKLOADS: dict[str, list[str]] = {
    # the Mooncake conversation trace, three 10-minute windows, 8 H100 stand-ins
    "conversation": ["--replicas", "8", "--slo", "2", "--windows", "0:600,600:600,1200:600"],
    # tool/agent traffic on a few popular system prompts
    "hot-prefix": ["--trace", "hot-prefix", "--requests", "2000", "--rate", "20", "--replicas", "8", "--slo", "2",
                   "--seeds", "0,1,2"],
    # Tree-of-Thoughts, branching 2
    "tot2": ["--trace", "tot2", "--requests", "2000", "--rate", "20", "--replicas", "8", "--slo", "2",
             "--seeds", "0,1,2"],
    # many customers with long shared contexts, KV demand > 90% of capacity (as the
    # precise-vs-history benchmark): 40 contexts of 4,096 tokens on 4 L4 replicas
    "kv-constrained": ["--trace", "hot-prefix", "--requests", "1200", "--rate", "1", "--hot-prompts", "40",
                       "--hot-prompt-blocks", "8", "--hot-share", "0.9", "--replicas", "4",
                       "--profile", "l4-llama3.1-8b", "--block-size", "16", "--slo", "2", "--warmup-s", "20",
                       "--seeds", "0,1,2"],
}
VARIANT_OPTIONS = {"dualmap-nowait": ("dualmap", ["wait_for_faster_candidate=false"])}


def workload_args(name: str, resolution: float) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sim_setup.add_arguments(p)
    return p.parse_args([*WORKLOADS[name], "--goodput-search", "--resolution", str(resolution)])


def system_args(args: argparse.Namespace, label: str) -> tuple[argparse.Namespace, str]:
    """A label is a system, optionally with the balancer's queue discipline after a slash
    (``dualmap/prefix``: dualmap behind FEATHER's order; no slash: the workload's, fcfs)."""
    system, _, discipline = label.partition("/")
    policy, options = VARIANT_OPTIONS.get(system, (system, []))
    over: dict[str, Any] = {"policy_option": [*args.policy_option, *options]}
    if discipline:
        over["queue_discipline"] = discipline
    return argparse.Namespace(**{**vars(args), **over}), policy


def run_search(label: str, args: argparse.Namespace, v: dict[str, Any]) -> dict[str, Any]:
    a, policy = system_args(args, label)
    return search_one(a, policy, v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--systems", default="dualmap,dualmap-nowait,prefix_tree,preble,min_ttft,cache_aware")
    ap.add_argument("--resolution", type=float, default=0.05)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="bench-out/ranking_matrix.json")
    cli = ap.parse_args()
    names = cli.workloads.split(",")
    labels = cli.systems.split(",")
    t0 = time.perf_counter()
    wl = {n: workload_args(n, cli.resolution) for n in names}
    vs = {n: variants(a) for n, a in wl.items()}
    jobs = [(n, label, i) for n in names for label in labels for i in range(len(vs[n]))]
    results: dict[tuple[str, str, int], dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=cli.jobs) as pool:
        futs = {pool.submit(run_search, label, wl[n], vs[n][i]): (n, label, i) for n, label, i in jobs}
        for f in as_completed(futs):
            key = futs[f]
            results[key] = f.result()
            r = results[key]
            print(f"{key[0]} {key[1]} variant {key[2]}: x{r['goodput_multiplier']:.3f} "
                  f"({len(r['evaluated'])} runs, {r['wall_s']} s; {time.perf_counter() - t0:.0f} s so far)",
                  flush=True)
    report: dict[str, Any] = {"resolution": cli.resolution, "workloads": {}}
    lines = []
    for n in names:
        rates = [base_rate(with_variant(wl[n], v)) for v in vs[n]]
        bound = [bounds(with_variant(wl[n], v)) for v in vs[n]]
        goodputs = {label: [results[(n, label, i)]["goodput_multiplier"] * (rates[i] or 1.0)
                            for i in range(len(vs[n]))] for label in labels}
        claims = ranking_statements(goodputs, cli.resolution)
        rows = []
        lines += [f"### {n}", "", "| system | goodput (req/s) per variant | mean | spread | hit rate at goodput | "
                  "P90 TTFT at goodput (s) |", "|---|---|---|---|---|---|"]
        for label in labels:
            per = [results[(n, label, i)] for i in range(len(vs[n]))]
            sp = Spread(tuple(goodputs[label]))
            hits = [r["prefix_hit_rate"] for r in per]
            p90 = [r["ttft_p90"] for r in per]
            rows.append({"system": label, "goodput": goodputs[label], "hit_rate": hits, "ttft_p90": p90,
                         "searches": per})

            def each(xs: list[Any]) -> str:
                return " / ".join("-" if x is None else f"{x:.3g}" for x in xs)
            lines.append(f"| {label} | {each(goodputs[label])} | {sp.mean:.3g} | {sp.low:.3g}-{sp.high:.3g} | "
                         f"{each(hits)} | {each(p90)} |")
        lines.append(f"| oracle / realistic bound (hit rate) | | | | {' / '.join(str(b['oracle']) for b in bound)} ; "
                     f"{' / '.join(str(b['lru']) for b in bound)} | |")
        lines += ["", *[f"- {c}" for c in claims], ""]
        report["workloads"][n] = {"args": WORKLOADS[n], "variants": vs[n], "base_rates": rates, "bounds": bound,
                                  "rows": rows, "rankings": claims}
    out = Path(cli.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(report, indent=1))
    print("\n".join(lines))
    print(f"wrote {out} ({report['wall_s']} s)")


if __name__ == "__main__":
    main()
