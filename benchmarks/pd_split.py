"""Prefill/decode pairs in the discrete-event simulator: goodput under a TTFT and a TBT
target, at equal total replicas, aggregated vs fixed P/D splits vs the peers' threshold
rule vs Mooncake's Conductor (skymesh/routing/pairing).

One region of ``--replicas`` replicas of ``--profile``, the project's routing (dualmap,
selective pushing) unchanged; a request counts when it is served with TTFT <= ``--ttft``
and TBT (the mean of its longest 10% token intervals, Mooncake's) <= ``--tbt``. Goodput is
the highest rate (req/s for the synthetic workloads, a rate multiplier for the trace) at
which at least 90% count, found by bisection (skymesh/bench/ranking.py) on every seed
(synthetic) or window (trace). Systems:

- ``aggregated``: every replica ``both``, no pair rule;
- ``always@P:D``: P prefill-only and D decode-only replicas, every request split;
- ``threshold@P:D``: the peers' conditional rule on that split (256 tokens; vllm-router 0.1.17's P/D mode itself splits every request: docs/benchmarks.md, live section);
- ``conductor@P:D``: Mooncake's Algorithm 1 on that split (P + D < replicas leaves the rest
  ``both``, where the conductor chooses per request between whole and split);
- ``elastic@P:D``: the conductor over roles that follow the load (``elastic@0:0``: every
  replica ``both``, and every 2 s the rule's role plan sets k of them decode-only and the
  rest prefill-only, k = 0 being aggregated: skymesh/routing/pairing/elastic.py);
- ``rule@P:D+option``: any of them with a boolean option of its rule set (``+`` again for
  more), e.g. ``conductor@6:2+prefill_pool``.

    PYTHONPATH=. .venv/bin/python -m benchmarks.pd_split --workloads long,chat,conversation \\
        --seeds 0,1 --jobs 2 --out bench-out/pd_split.json [--png FIG.png]
    PYTHONPATH=. .venv/bin/python -m benchmarks.pd_split --replot A.json [B.json ...] --png FIG.png

The conversation trace is read from ``--trace`` (default ../shared/traces/mooncake_conversation.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from skymesh.bench.des import Simulator
from skymesh.bench.figures import load_json, merge_pd_results, pd_figure
from skymesh.bench.pd_workloads import long_context, short_chat
from skymesh.bench.ranking import bisect_goodput
from skymesh.bench.sim_config import SimConfig
from skymesh.bench.traces import TraceRequest, load_mooncake, scale_rate, window
from skymesh.bench.verdict import StopWhen, VerdictWatch
from skymesh.bench.verdict import attainment as verdict_attainment

DEFAULT_TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces",
                             "mooncake_conversation.jsonl")
REGION = "central"
# (start rate, seconds of arrivals) per synthetic workload; the trace's windows are 600 s
SYNTHETIC = {"long": (long_context, 4.0, 120.0), "chat": (short_chat, 60.0, 40.0)}
TRACE_WINDOW_S = 600.0
# the share of requests within both targets a rate must serve to count
TARGET = 0.9


def system_options(system: str) -> dict[str, bool]:
    """``rule@P:D+a+b`` -> {"a": True, "b": True} (the rule's options; the registry
    refuses a name the rule does not have)."""
    _, *flags = system.split("+")
    return dict.fromkeys(flags, True)


def parse_system(system: str, replicas: int) -> tuple[str, tuple[int, int]]:
    """``rule@P:D`` (options after ``+`` left out) -> (rule, (P, D)); ``aggregated`` ->
    ("never", (0, 0))."""
    system = system.split("+")[0]
    if system == "aggregated":
        return "never", (0, 0)
    rule, _, split = system.partition("@")
    p, _, d = split.partition(":")
    n_prefill, n_decode = int(p), int(d)
    if n_prefill + n_decode > replicas or min(n_prefill, n_decode) < 0:
        raise ValueError(f"{system}: the split needs more than {replicas} replicas")
    return rule, (n_prefill, n_decode)


def workload(name: str, seed: int, rate: float, trace: Sequence[TraceRequest] | None) -> list[TraceRequest]:
    if name in SYNTHETIC:
        make, _, seconds = SYNTHETIC[name]
        return make(max(50, int(rate * seconds)), rate, seed=seed)
    assert trace is not None
    return scale_rate(window(trace, seed * TRACE_WINDOW_S, TRACE_WINDOW_S), rate)


def attainment(args: argparse.Namespace, system: str, name: str, seed: int, rate: float,
               trace: Sequence[TraceRequest] | None) -> dict[str, float]:
    rule, split = parse_system(system, args.replicas)
    cfg = SimConfig(regions={REGION: args.replicas}, profile=args.profile, block_size=args.block_size,
                    pd_split={REGION: split}, pair_rule=rule, pair_options=system_options(system),
                    tbt_slo_s=args.tbt, record_tbt=True)
    reqs = workload(name, seed, rate, trace)
    watch = None
    if not args.no_early_stop:
        # only the verdict of a rate that misses matters: its run stops once it is certain
        watch = VerdictWatch.for_requests((REGION,), [q.arrival_s for q in reqs], [REGION] * len(reqs),
                                          slo_s=args.ttft, target=TARGET, when=StopWhen.ANY_REGION_FAILS,
                                          tbt_slo_s=args.tbt)
    r = Simulator(cfg).run(reqs, watch=watch)
    if r.stopped_early:
        assert watch is not None
        return {"attainment": watch.upper(0), "stopped_early": r.stopped_early}
    served = ~r.rejected
    ok = served & (r.ttft <= args.ttft) & (r.tbt <= args.tbt)
    return {"attainment": verdict_attainment(int(ok.sum()), int(ok.size)), "ttft_ok": float((served & (r.ttft <= args.ttft)).mean()),
            "tbt_ok": float((served & (r.tbt <= args.tbt)).mean()), "split": float(r.split.mean()),
            "p90_ttft_s": float(np.nanpercentile(r.ttft, 90)), "p50_tbt_s": float(np.nanmedian(r.tbt))}


def search(job: tuple[argparse.Namespace, str, str, int]) -> dict[str, Any]:
    args, system, name, seed = job
    trace = load_mooncake(args.trace) if name == "conversation" else None
    at: dict[float, dict[str, float]] = {}

    def attainment_at(rate: float) -> float:
        at[rate] = attainment(args, system, name, seed, rate, trace)
        return at[rate]["attainment"]

    start = SYNTHETIC[name][1] if name in SYNTHETIC else 2.0
    found = bisect_goodput(attainment_at, start=start, target=TARGET, resolution=args.resolution, max_rate=512.0)
    best = at.get(found.goodput, {})
    return {"system": system, "workload": name, "seed": seed, "goodput": found.goodput,
            "bracket": list(found.bracket), "at_goodput": best,
            "evaluated": [[rate, at[rate]] for rate, _ in found.evaluated]}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="long,chat,conversation")
    ap.add_argument("--systems", default="aggregated,always@2:6,always@3:5,always@4:4,always@5:3,always@6:2,"
                                        "threshold@5:3,conductor@5:3,conductor@2:2")
    ap.add_argument("--seeds", default="0,1", help="synthetic: arrival seeds; conversation: 600-s windows")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--profile", default="h100-qwen2.5-7b")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--ttft", type=float, default=2.0)
    ap.add_argument("--tbt", type=float, default=0.1)
    ap.add_argument("--no-early-stop", action="store_true",
                    help="run every rate's day whole, even once it is certain to miss (the goodput is the same)")
    ap.add_argument("--resolution", type=float, default=0.05)
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", default="bench-out/pd_split.json")
    ap.add_argument("--png", default=None, metavar="PATH",
                    help="also draw the results page's figure (goodput over aggregated's per workload) to PATH")
    ap.add_argument("--replot", default=None, metavar="JSON", nargs="+",
                    help="run nothing: draw --png from JSON files this command wrote earlier (a later file's "
                         "system, workload and seed replace an earlier one's), the systems of --systems in its order")
    args = ap.parse_args(argv)
    if args.replot:
        if not args.png:
            raise SystemExit("--replot: name the figure's file with --png PATH")
        order = {s: i for i, s in enumerate(args.systems.split(","))}
        merged = [r for r in merge_pd_results(load_json(path) for path in args.replot) if r["system"] in order]
        print(f"wrote {pd_figure(sorted(merged, key=lambda r: order[r['system']]), Path(args.png))}")
        return 0
    systems = args.systems.split(",")
    for s in systems:
        parse_system(s, args.replicas)
    jobs = [(args, s, w, int(seed)) for w in args.workloads.split(",") for seed in args.seeds.split(",")
            for s in systems]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(search, jobs))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(render(results, systems))
    if args.png:
        print(f"wrote {pd_figure(results, Path(args.png))}")
    return 0


def render(results: list[dict[str, Any]], systems: list[str]) -> str:
    """Goodput per system and workload (mean [lowest–highest] over the seeds) and its
    ratio to aggregated's, seed by seed."""
    by: dict[tuple[str, str], dict[int, float]] = {}
    for r in results:
        by.setdefault((r["system"], r["workload"]), {})[r["seed"]] = r["goodput"]
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    lines = ["| system | " + " | ".join(f"{w} goodput | {w} ÷ aggregated" for w in workloads) + " |",
             "|---|" + "---|---|" * len(workloads)]
    for s in systems:
        cells = []
        for w in workloads:
            g = by.get((s, w), {})
            base = by.get(("aggregated", w), {})
            vals = [g[k] for k in sorted(g)]
            ratios = [g[k] / base[k] for k in sorted(g) if base.get(k)]
            cells.append(f"{np.mean(vals):.2f} [{min(vals):.2f}–{max(vals):.2f}]" if vals else "—")
            cells.append(f"{np.mean(ratios):.2f} [{min(ratios):.2f}–{max(ratios):.2f}]" if ratios else "—")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
