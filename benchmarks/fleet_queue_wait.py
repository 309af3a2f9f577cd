"""How long requests wait in a balancer's queue when a simulated region is a fleet.

Why a region of 5 balancers over 3 replicas loses SLO attainment where 1, 2 or 3 do not
(docs/benchmarks.md, "A region is a fleet (DES)"): runs one ``skymesh sim`` day and
records, for every request a region's balancers place on their own replicas, the time
from its arrival at a balancer (``RegionCore.submit``) to its placement (the dispatch
round that places it), per balancer. The routing code is the project's own and runs
unchanged: the two methods are wrapped only to read the simulated clock at those two
points. Retries and a request placed again count once per placement.

    PYTHONHASHSEED=0 PYTHONPATH=. .venv/bin/python -m benchmarks.fleet_queue_wait \\
        --region eu-west-1 -- --regions 3 --diurnal-period-s 1200 --duration-s 1200 --slo 2 \\
        --replicas 3 --rates 8.37 --seed 0 --systems dualmap --jobs 1 --balancers-per-region 5

Everything after ``--`` is ``skymesh sim``'s own options (one system, one rate).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from skymesh.bench import sim_setup
from skymesh.routing.dispatcher import BalancerCore
from skymesh.routing.region import RegionCore


def record_queue_waits(region: str) -> tuple[dict[str, list[float]], Callable[[], None]]:
    """Wrap the region core's submit and the dispatcher's dispatch round so that every
    placement in ``region`` records its queue wait under its balancer's id. Returns the
    waits and a function that undoes the wrapping."""
    arrived: dict[str, tuple[float, str]] = {}
    waits: dict[str, list[float]] = defaultdict(list)
    submit, dispatch = RegionCore.submit, BalancerCore.dispatch

    def timed_submit(core: RegionCore, req: Any, now: float, **kw: Any) -> Any:
        if core.region == region:
            member = core.siblings.balancer_id if core.siblings is not None else region
            arrived[req.request_id] = (now, member)
        return submit(core, req, now, **kw)

    def timed_dispatch(local: BalancerCore, now: float) -> Any:
        placed = dispatch(local, now)
        for req, _decision in placed:
            seen = arrived.pop(req.request_id, None)
            if seen is not None:
                waits[seen[1]].append(now - seen[0])
        return placed

    RegionCore.submit = timed_submit  # type: ignore[method-assign]
    BalancerCore.dispatch = timed_dispatch  # type: ignore[method-assign]

    def undo() -> None:
        RegionCore.submit = submit  # type: ignore[method-assign]
        BalancerCore.dispatch = dispatch  # type: ignore[method-assign]

    return waits, undo


def percentiles(values: Sequence[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99]) if a.size else (float("nan"),) * 3
    return {"placements": int(a.size), "p50_s": round(float(p50), 3), "p90_s": round(float(p90), 3),
            "p99_s": round(float(p99), 3)}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sim_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    own_argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--region", required=True, help="the region whose queue waits are recorded")
    args = ap.parse_args(own_argv)
    sp = argparse.ArgumentParser(prog="skymesh sim")
    sim_setup.add_arguments(sp)
    sim_args = sp.parse_args(sim_argv)
    systems = sim_setup.systems_of(sim_args)
    rates = [float(x) for x in sim_args.rates.split(",")]
    if len(systems) != 1 or len(rates) != 1:
        ap.error("give skymesh sim one system and one rate")
    regions = sim_setup.mesh_of(sim_args).names
    if args.region not in regions:
        ap.error(f"--region {args.region!r} is not simulated (the run's regions: {', '.join(regions)})")
    waits, undo = record_queue_waits(args.region)
    try:
        res = sim_setup.run_one(sim_args, systems[0], rates[0], False)
    finally:
        undo()
    m = res["metrics"]
    region = (m.get("regions") or {}).get(args.region, {})
    out = {
        "slo_attainment": m["slo_attainment"], "prefix_hit_rate": m["prefix_hit_rate"],
        "region_slo_attainment": region.get("slo_attainment"),
        "queue_wait": percentiles([w for ws in waits.values() for w in ws]),
        "queue_wait_per_balancer": {b: percentiles(ws) for b, ws in sorted(waits.items())},
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
