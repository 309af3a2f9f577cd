"""The precise cache view (replicas' KV events into the region core's block index) vs the
approximate one (the routing-history trie), in the discrete-event simulator, per
cache-aware policy and seed, on a KV-constrained hot-prefix workload (docs/benchmarks.md,
"Precise (KV events) vs approximate (routing history), DES").

    .venv/bin/python -m benchmarks.precise_vs_history [--seeds 0,1] [--views events,history] [--out FILE]

Each cell is one ``skymesh sim`` run (``sim_setup.run_one``) with the arguments below plus
``--cache-view``, ``--seed`` and ``--systems POLICY``; the sweep over ``--rates`` gives
goodput, the rest is read at ``--at`` (the rate multiplier near saturation).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skymesh.bench import sim_setup  # noqa: E402
from skymesh.bench.scores import goodput  # noqa: E402

POLICIES = "prefix_tree,preble,dualmap,min_ttft,cache_aware"
SIM_ARGS = ["--trace", "hot-prefix", "--requests", "1200", "--rate", "1", "--hot-prompts", "40",
            "--hot-prompt-blocks", "8", "--hot-share", "0.9", "--replicas", "4", "--profile", "l4-llama3.1-8b",
            "--block-size", "16", "--slo", "2", "--warmup-s", "20"]


def sim_args(view: str, seed: int, rates: str) -> argparse.Namespace:
    """``view``: events, history (512-token chunks) or history-c16 (history with chunks of
    one 16-token block, as the events view has: separates granularity from precision)."""
    p = argparse.ArgumentParser()
    sim_setup.add_arguments(p)
    extra = ["--chunk-tokens", "16"] if view == "history-c16" else []
    return p.parse_args([*SIM_ARGS, "--rates", rates, "--cache-view", view.partition("-")[0], "--seed", str(seed),
                         *extra])


def cell(policy: str, view: str, seed: int, rates: list[float], at: float) -> dict[str, Any]:
    args = sim_args(view, seed, ",".join(f"{r:g}" for r in rates))
    points = {r: sim_setup.run_one(args, policy, r, False)["metrics"] for r in rates}
    m = points[at]
    return {"policy": policy, "view": view, "seed": seed,
            "goodput": round(goodput([(p["rate"], p["slo_attainment"]) for p in points.values()]), 3),
            "rate_at": m["rate"], "attainment": m["slo_attainment"], "ttft_p90": m["ttft_p90"],
            "hit_rate": m["prefix_hit_rate"], "pred_within_block": m["prediction_within_block"],
            "pred_over": m["prediction_over"]}


def _spread(vals: list[float], fmt: str) -> str:
    if len(vals) == 1:
        return format(vals[0], fmt)
    return " / ".join(format(v, fmt) for v in vals)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--rates", default="1.5,2,2.5,3")
    ap.add_argument("--at", type=float, default=2.5, help="rate multiplier the other columns are read at")
    ap.add_argument("--views", default="events,history", help="events, history, history-c16")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="bench-out/precise_vs_history.json")
    a = ap.parse_args()
    rates = [float(x) for x in a.rates.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    views = a.views.split(",")
    cells = [(p, v, s) for p in a.policies.split(",") for v in views for s in seeds]
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(cell, *zip(*cells, strict=True), [rates] * len(cells), [a.at] * len(cells)))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"sim_args": SIM_ARGS, "rates": rates, "at": a.at, "cells": results}, indent=1))
    by = {(r["policy"], r["view"], r["seed"]): r for r in results}
    print(f"seeds {seeds} (values per seed, '/'-separated); columns other than goodput at x{a.at:g}\n")
    print("| policy | view | goodput (req/s) | SLO attainment | P90 TTFT (s) | prefix hit rate "
          "| predicted within 1 block | over-predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for p in a.policies.split(","):
        for v in views:
            rs = [by[(p, v, s)] for s in seeds]
            print(f"| {p} | {v} | {_spread([r['goodput'] for r in rs], '.2f')} "
                  f"| {_spread([r['attainment'] for r in rs], '.3f')} | {_spread([r['ttft_p90'] for r in rs], '.2f')} "
                  f"| {_spread([r['hit_rate'] for r in rs], '.3f')} "
                  f"| {_spread([r['pred_within_block'] for r in rs], '.3f')} "
                  f"| {_spread([r['pred_over'] for r in rs], '.3f')} |")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
