"""Geo: how many replicas region-local serving needs for the goodput of the mesh with
cross-region offload, on a balanced 3-region diurnal day (issue "Routing that wins").

The Mooncake conversation trace's first 20 minutes as one compressed day: sessions spread
evenly over us-east-1 / eu-west-1 / ap-northeast-1 (no skew), each region's arrivals
thinned by its own diurnal curve (amplitude 0.8, period = the window), peaks a third of a
period (8 "hours") apart; one-way latencies 40/80/110 ms; TTFT SLO 2 s. Every
configuration's goodput by bisection (``skymesh sim --goodput-search``) on three arrival
seeds. Region-local (``dualmap@local``) at 3, 4 and 5 replicas per region gives, per
seed, the replicas per region it needs for a goodput (linear between the two counts
around it); a mesh configuration's saving is 1 - its replicas / what region-local needs
for its goodput. The pooled bound of the same 9 replicas (every replica one pool, no
residency rule; skymesh/bench/des.py) is searched too, and each 9-replica configuration
is given as a fraction of it.

    .venv/bin/python -m benchmarks.geo_day [--jobs 2] [--out bench-out/geo_day.json]
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
from skymesh.bench.ranking import Spread  # noqa: E402
from skymesh.bench.search_main import base_rate, search_one, variants, with_variant  # noqa: E402

DAY = ["--regions", "3", "--diurnal-period-s", "1200", "--duration-s", "1200", "--slo", "2", "--seeds", "0,1,2"]
LOCAL_COUNTS = (3, 4, 5)
POOLED = "pooled bound 3/region (skymesh/bench/des.py)"
# label -> (extra sim arguments, system, total replicas)
CONFIGS: dict[str, tuple[list[str], str, int]] = {
    **{f"region-local {n}/region": (["--replicas", str(n)], "dualmap@local", 3 * n) for n in LOCAL_COUNTS},
    "mesh 3/region, EU rule, predicted-TTFT offload": (["--replicas", "3"], "dualmap", 9),
    "mesh 3/region, EU rule, saturated offload": (["--replicas", "3", "--offload-trigger", "saturated"], "dualmap", 9),
    "mesh 3/region, no residency rule, predicted-TTFT offload": (["--replicas", "3", "--no-eu-rule"], "dualmap", 9),
    "mesh 3/region, no residency rule, saturated offload": (
        ["--replicas", "3", "--no-eu-rule", "--offload-trigger", "saturated"], "dualmap", 9),
    "mesh EU 4 + US 3 + AP 3, EU rule, predicted-TTFT offload": (
        ["--replicas", "3", "--region-replicas", "eu-west-1=4"], "dualmap", 10),
    "mesh EU 4 + US 2 + AP 2, EU rule, predicted-TTFT offload": (
        ["--replicas", "2", "--region-replicas", "eu-west-1=4"], "dualmap", 8),
    # every replica one pool, no residency rule: the most cross-region offload could give
    POOLED: (["--replicas", "3"], "dualmap@pooled", 9),
}


def config_args(label: str, resolution: float) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sim_setup.add_arguments(p)
    extra, system, _ = CONFIGS[label]
    return p.parse_args([*DAY, *extra, "--systems", system, "--goodput-search", "--resolution", str(resolution)])


def needed_per_region(goodput: float, local: dict[int, float]) -> float:
    """Replicas per region region-local needs for ``goodput``: linear between the counts
    around it (beyond the measured range: extended from the nearest two)."""
    counts = sorted(local)
    for lo, hi in zip(counts, counts[1:], strict=False):
        if goodput <= local[hi] or hi == counts[-1]:
            return lo + (goodput - local[lo]) * (hi - lo) / (local[hi] - local[lo])
    return float(counts[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--resolution", type=float, default=0.05)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="bench-out/geo_day.json")
    cli = ap.parse_args()
    t0 = time.perf_counter()
    args = {label: config_args(label, cli.resolution) for label in CONFIGS}
    vs = {label: variants(a) for label, a in args.items()}
    jobs = [(label, i) for label in CONFIGS for i in range(len(vs[label]))]
    results: dict[tuple[str, int], dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=cli.jobs) as pool:
        futs = {pool.submit(search_one, args[label], CONFIGS[label][1], vs[label][i]): (label, i) for label, i in jobs}
        for f in as_completed(futs):
            results[futs[f]] = r = f.result()
            print(f"{futs[f][0]} variant {futs[f][1]}: x{r['goodput_multiplier']:.3f} "
                  f"({time.perf_counter() - t0:.0f} s so far)", flush=True)
    n_var = len(vs[next(iter(CONFIGS))])
    rates = [base_rate(with_variant(args[next(iter(CONFIGS))], vs[next(iter(CONFIGS))][i])) or 1.0
             for i in range(n_var)]
    goodput = {label: [results[(label, i)]["goodput_multiplier"] * rates[i] for i in range(n_var)]
               for label in CONFIGS}
    local = [{n: goodput[f"region-local {n}/region"][i] for n in LOCAL_COUNTS} for i in range(n_var)]
    rows = []
    lines = ["| configuration | replicas | goodput (req/s) per seed | mean | region-local replicas/region "
             "for it, per seed | fewer replicas than region-local, per seed | mean | x the pooled bound (9 replicas) |",
             "|---|---|---|---|---|---|---|---|"]
    for label, (_, _, total) in CONFIGS.items():
        g = goodput[label]
        need = [needed_per_region(g[i], local[i]) for i in range(n_var)]
        saving = [1 - total / (3 * x) for x in need]
        # the same 9 replicas as one pool: the mesh's share of what offload could give at most
        of_pooled = [x / b for x, b in zip(g, goodput[POOLED], strict=True)] if total == 9 else None
        rows.append({"configuration": label, "replicas": total, "goodput": g, "needed_per_region": need,
                     "saving": saving, "of_pooled": of_pooled, "hit_rate": [results[(label, i)]["prefix_hit_rate"] for i in range(n_var)],
                     "ttft_p90": [results[(label, i)]["ttft_p90"] for i in range(n_var)]})
        local_row = label.startswith("region-local")
        lines.append(f"| {label} | {total} | {' / '.join(f'{x:.1f}' for x in g)} | {Spread(tuple(g)).mean:.1f} | "
                     + ("- | - | - |" if local_row else
                        f"{' / '.join(f'{x:.2f}' for x in need)} | {' / '.join(f'{x:.0%}' for x in saving)} | "
                        f"{sum(saving) / len(saving):.0%} |")
                     + (f" {' / '.join(f'{x:.3f}' for x in of_pooled)} |" if of_pooled else " |"))
    out = Path(cli.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"day": DAY, "variants": vs[next(iter(CONFIGS))], "base_rates": rates, "rows": rows,
              "resolution": cli.resolution, "wall_s": round(time.perf_counter() - t0, 1)}
    out.write_text(json.dumps(report, indent=1))
    print("\n".join(lines))
    print(f"wrote {out} ({report['wall_s']} s)")


if __name__ == "__main__":
    main()
