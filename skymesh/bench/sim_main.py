"""`skymesh sim --trace FILE --systems a,b,c --out DIR`: the discrete-event benchmark.

Every system runs on the same replicas, the same trace and the same seed. A system name
is a policy from the registry (`dualmap`, `prefix_tree`, ...); with several regions,
`NAME@local` is the same policy without cross-region offload (region-local).
"""

from __future__ import annotations

import argparse
import fnmatch
import time
from pathlib import Path
from typing import Any

from skymesh.bench.des import SimConfig, Simulator
from skymesh.bench.metrics import goodput, summarize
from skymesh.bench.report import markdown_table, write_report
from skymesh.bench.traces import (
    assign_regions,
    diurnal,
    hot_prefix_workload,
    load_mooncake,
    oracle_hit_rate,
    scale_rate,
    window,
)

DEFAULT_TRACE = str(Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation.jsonl")
GEO_REGIONS = {"us-east-1": 0, "eu-west-1": 0, "ap-northeast-1": 0}
GEO_LATENCY = {("us-east-1", "eu-west-1"): 40.0, ("us-east-1", "ap-northeast-1"): 80.0,
               ("eu-west-1", "ap-northeast-1"): 110.0}


def eu_stays_in_eu(source: str, target: str) -> bool:
    """The local default's GDPR-style rule: eu-* regions offload only to eu-*."""
    return not fnmatch.fnmatchcase(source, "eu-*") or fnmatch.fnmatchcase(target, "eu-*")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake JSONL trace, or 'hot-prefix' (synthetic)")
    p.add_argument("--systems", default="dualmap,prefix_tree,cache_aware,min_ttft,preble,least_load,round_robin,consistent_hash")
    p.add_argument("--out", default="bench-out/sim")
    p.add_argument("--replicas", type=int, default=16, help="replicas per region")
    p.add_argument("--regions", type=int, default=1, choices=(1, 3), help="1 (central) or 3 (geo mesh)")
    p.add_argument("--skew", type=float, default=0.0, help="extra share of sessions in the first region")
    p.add_argument("--diurnal-period-s", type=float, default=0.0, help="per-region diurnal curve (0: off)")
    p.add_argument("--profile", default="h100-qwen2.5-7b")
    p.add_argument("--slo", type=float, default=2.0, help="TTFT SLO in seconds")
    p.add_argument("--rates", default="1", help="comma-separated rate multipliers for the goodput sweep")
    p.add_argument("--start-s", type=float, default=0.0, help="trace window start")
    p.add_argument("--duration-s", type=float, default=0.0, help="trace window length (0: whole trace)")
    p.add_argument("--first-n", type=int, default=None)
    p.add_argument("--max-fuse-s", type=float, default=0.02)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)


def _trace(args: argparse.Namespace) -> list[Any]:
    if args.trace == "hot-prefix":
        return hot_prefix_workload(n=args.first_n or 4000, rate_per_s=20.0, seed=args.seed)
    reqs = load_mooncake(args.trace, args.first_n)
    if args.duration_s > 0:
        reqs = window(reqs, args.start_s, args.duration_s)
    return reqs


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    base = _trace(args)
    systems = [s for s in args.systems.split(",") if s]
    rates = [float(x) for x in args.rates.split(",")]
    if args.regions == 3:
        names = list(GEO_REGIONS)
        base = assign_regions(base, names, args.skew, args.seed)
        if args.diurnal_period_s > 0:
            base = diurnal(base, names, args.diurnal_period_s, seed=args.seed)
    span = max(1e-9, max(r.arrival_s for r in base) - min(r.arrival_s for r in base))
    out = Path(args.out)
    summaries: dict[str, dict[str, Any]] = {}
    sweeps: dict[str, list[dict[str, Any]]] = {}
    ttfts: dict[str, list[float]] = {}
    load_first: list[tuple[float, dict[str, int]]] = []
    wall: dict[str, float] = {}
    for system in systems:
        policy, _, variant = system.partition("@")
        sweeps[system] = []
        for rate in rates:
            trace = scale_rate(base, rate)
            if args.regions == 3:
                regions = {n: args.replicas for n in GEO_REGIONS}
                cfg = SimConfig(policy=policy, regions=regions, one_way_ms=GEO_LATENCY, profile=args.profile,
                                ttft_slo_s=args.slo, offload=variant != "local", allowed=eu_stays_in_eu,
                                max_fuse_s=args.max_fuse_s, block_size=args.block_size)
            else:
                cfg = SimConfig(policy=policy, regions={"central": args.replicas}, profile=args.profile,
                                ttft_slo_s=args.slo, max_fuse_s=args.max_fuse_s, block_size=args.block_size)
            sim = Simulator(cfg)
            t0 = time.perf_counter()
            with tqdm(total=len(trace), desc=f"{system} x{rate:g}", unit="req", leave=False, mininterval=2.0) as bar:
                results = list(sim.run(trace, progress=bar.update).values())
            wall[f"{system}@x{rate:g}"] = round(time.perf_counter() - t0, 2)
            m = summarize(results, args.slo, sim.prefix_hit_rate(), (s for _, s in sim.load_samples))
            m["rate"] = round(len(trace) / (span / rate), 4)
            m["rate_multiplier"] = rate
            sweeps[system].append(m)
            if rate == rates[0]:
                ttfts[system] = [r.ttft for r in results if r.ttft is not None]
                if not load_first:
                    load_first = sim.load_samples
        first = sweeps[system][0]
        summaries[system] = {**first, "goodput": round(goodput([(p["rate"], p["slo_attainment"])
                                                                for p in sweeps[system]]), 4)}
    config = {"trace": args.trace, "requests": len(base), "replicas_per_region": args.replicas,
              "regions": args.regions, "profile": args.profile, "slo_s": args.slo, "rates": rates,
              "skew": args.skew, "diurnal_period_s": args.diurnal_period_s,
              "oracle_prefix_hit_rate": round(oracle_hit_rate(base), 4), "wall_s": wall, "mode": "discrete-event"}
    write_report(out, summaries, config, sweeps, ttfts, load_first, systems[0])
    print(markdown_table(summaries))
    print(f"\noracle (infinite shared cache) prefix hit rate: {config['oracle_prefix_hit_rate']}")
    print(f"wall time per run (s): {wall}")
    print(f"wrote {out}/results.json, results.md, ttft_cdf.png, goodput_vs_rate.png, replica_load.png")
    return 0
