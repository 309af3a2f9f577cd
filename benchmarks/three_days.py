"""Geo: three days of different shape, each planned with ``skymesh plan`` (issue "The
planet as one pool").

For each day and arrival seed:

1. ``skymesh plan --no-eu-rule --pooled-bound``: the fewest replicas per region for
   region-local serving, for the mesh (cross-region offload) and for the pooled bound
   (every replica one pool);
2. ``skymesh plan`` under the EU rule (eu-* clients served in eu-* only);
3. ``skymesh sim --goodput-search --pooled-bound`` on the mesh's layout from 1: the mesh's
   goodput as a fraction of the pooled bound's on the same replicas.

The days (the Mooncake conversation trace; 3 regions, one-way 40/80/110 ms; TTFT SLO 2 s;
each planned at a load of about 19 req/s on average):

- ``balanced``: the first 20 minutes, sessions even, peaks a third of a period apart,
  amplitude 0.8 everywhere ("Geo: a balanced diurnal day");
- ``close-peaks``: minutes 20-40, 45 / 35 / 20% of sessions, us-east-1 and eu-west-1
  peaking an eighth of a period (3 "hours") apart and ap-northeast-1 opposite, amplitudes
  0.9 / 0.7 / 0.6;
- ``one-big-region``: minutes 38-58, 20 / 20 / 60% of sessions (ap-northeast-1 the big
  one), peaks at 0 / 0.6 / 0.3 of the period, amplitudes 0.5 / 0.95 / 0.8.

    PYTHONPATH=. .venv/bin/python -m benchmarks.three_days [--days balanced,...] [--seeds 0,1,2]
        [--jobs 2] [--out bench-out/three_days] [--load-factor 2 --no-goodput] [--png FIG.png]
    PYTHONPATH=. .venv/bin/python -m benchmarks.three_days --replot three_days.json --png FIG.png
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from skymesh.bench.figures import geo_figure, load_json

PERIOD = ["--regions", "3", "--diurnal-period-s", "1200", "--duration-s", "1200", "--slo", "2"]
# day -> (its shape, the rate multiplier it is planned at)
DAYS: dict[str, tuple[list[str], float]] = {
    "balanced": (["--start-s", "0"], 10.0),
    "close-peaks": (["--start-s", "1200", "--region-weights", "0.45,0.35,0.2", "--phases", "0,0.125,0.5",
                     "--amplitude", "0.9,0.7,0.6"], 9.0),
    "one-big-region": (["--start-s", "2300", "--region-weights", "0.2,0.2,0.6", "--phases", "0,0.6,0.3",
                        "--amplitude", "0.5,0.95,0.8"], 8.5),
}
SKYMESH = [sys.executable, "-m", "skymesh.cli"]


def run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True)


def one(day: str, seed: int, out: Path, extra: list[str], load_factor: float = 1.0,
        goodput: bool = True) -> dict[str, Any]:
    shape, mult = DAYS[day]
    mult *= load_factor
    base = [*PERIOD, *shape, *extra]
    d = out / day / f"seed{seed}"
    plan_args = ["plan", *base, "--rate-multiplier", str(mult), "--seeds", str(seed), "--jobs", "1"]
    run([*SKYMESH, *plan_args, "--no-eu-rule", "--pooled-bound", "--out", str(d / "free")], d / "free.log")
    free = json.loads((d / "free" / "plan.json").read_text())
    run([*SKYMESH, *plan_args, "--out", str(d / "eu")], d / "eu.log")
    eu = json.loads((d / "eu" / "plan.json").read_text())
    layout = ",".join(f"{r}={n}" for r, n in free["plans"]["mesh"].items())
    summary = {"day": day, "seed": seed, "rate_multiplier": mult, "free": {k: free[k] for k in
               ("plans", "replicas", "mesh_saving", "attainment", "offloaded", "day", "days", "shape_ceiling")
               if k in free},
               "eu": {k: eu[k] for k in ("plans", "replicas", "mesh_saving", "attainment", "offloaded")}}
    if not goodput:
        return summary
    run([*SKYMESH, "sim", *base, "--seeds", str(seed), "--no-eu-rule", "--region-replicas", layout,
         "--systems", "dualmap", "--pooled-bound", "--goodput-search", "--resolution", "0.02", "--jobs", "1",
         "--out", str(d / "goodput")], d / "goodput.log")
    search = json.loads((d / "goodput" / "search.json").read_text())
    return {**summary, "goodput_layout": layout, "goodput": search}


def layout_text(layout: dict[str, int]) -> str:
    return f"{' + '.join(str(n) for n in layout.values())} = {sum(layout.values())}"


def table(results: list[dict[str, Any]]) -> str:
    """The docs' table: per day and seed, each plan's layout (us / eu / ap = total), the
    mesh's saving and the day's shape ceiling, and the mesh's goodput on its layout as a
    fraction of the pooled bound's."""
    from skymesh.bench.plan_main import shape_ceiling

    lines = ["| day | seed | x rate (req/s) | region-local | mesh, no rule (saving) | pooled bound | shape ceiling | "
             "mesh goodput / pooled bound's, on the mesh's layout | mesh, EU rule (saving) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['day']} | {r['seed']} | {r['error']} | | | | | | |")
            continue
        free, eu = r["free"], r["eu"]
        rows = r.get("goodput", {}).get("rows", [])
        g = {row["system"]: row["goodput"][0] for row in rows}
        frac = (f"{g['dualmap']:.3g} / {g['dualmap@pooled']:.3g} = {g['dualmap'] / g['dualmap@pooled']:.3f}"
                if "dualmap" in g and g.get("dualmap@pooled") else "-")
        ceiling = free.get("shape_ceiling")
        if ceiling is None and "days" in free:
            ceiling = shape_ceiling(free["days"]["mesh"]["load"])
        lines.append(
            f"| {r['day']} | {r['seed']} | x{r['rate_multiplier']:g} ({free['day']['rate']:.1f}) | "
            f"{layout_text(free['plans']['region-local'])} | {layout_text(free['plans']['mesh'])} "
            f"({free['mesh_saving']:.0%}) | {layout_text(free['plans']['pooled bound'])} | "
            f"{'-' if ceiling is None else f'{ceiling:.0%}'} | {frac} | {layout_text(eu['plans']['mesh'])} "
            f"({eu['mesh_saving']:.0%}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--days", default=",".join(DAYS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default="bench-out/three_days")
    p.add_argument("--extra", default="", help="more sim/plan arguments, space-separated")
    p.add_argument("--load-factor", type=float, default=1.0,
                   help="plan every day at this many times its load (finer replica counts)")
    p.add_argument("--no-goodput", action="store_true", help="plans only, no goodput search on the mesh's layout")
    p.add_argument("--table", action="store_true", help="print the table of --out's three_days.json, run nothing")
    p.add_argument("--png", default=None, metavar="PATH",
                   help="also draw the results page's figure (replicas per plan; the mesh's saving against the "
                        "pooled bound's and the day's shape ceiling) to PATH")
    p.add_argument("--replot", default=None, metavar="THREE_DAYS_JSON",
                   help="run nothing: draw --png from a three_days.json this command wrote earlier")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.replot:
        if not args.png:
            raise SystemExit("--replot: name the figure's file with --png PATH")
        print(f"wrote {geo_figure(load_json(args.replot), Path(args.png))}")
        return 0
    if args.table:
        print(table(json.loads((out / "three_days.json").read_text())))
        return 0
    jobs = [(d, int(s)) for d in args.days.split(",") for s in args.seeds.split(",")]
    t0 = time.perf_counter()

    def job(day: str, seed: int) -> dict[str, Any]:
        try:
            return one(day, seed, out, args.extra.split(), args.load_factor, not args.no_goodput)
        except subprocess.CalledProcessError as e:  # that day's log says why; the others go on
            return {"day": day, "seed": seed, "error": f"{e.cmd[3]} exited {e.returncode}"}

    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda j: job(*j), jobs))
    (out / "three_days.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    if args.png:
        print(f"wrote {geo_figure(results, Path(args.png))}")
    print(f"wall {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
