"""The slo queue discipline's decision: its time, and its objective against exhaustive
search and against earliest-deadline-first (issue "Many SLOs").

Random heads of a priority's queue: requests 0-2 s old with TTFT targets of 0.5/1/2/5 s and
prefills of 20-800 ms, 1-3 replicas freeing within 0.5 s (the same generator as the tests).
Per (window, iterations): the time of one annealing decision (perf_counter_ns around
``anneal``, the collector tuned as the daemon's), and for windows up to 8 the share of
heads where it matches the exhaustive optimum's misses with a total TTFT within 1%, and
the misses it saves against EDF.

    .venv/bin/python -m benchmarks.slo_order [--heads 300] [--out bench-out/slo_order.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skymesh.routing.disciplines.slo_deadline import Candidate, anneal, schedule_cost  # noqa: E402
from skymesh.runtime.gc_tuning import tune_gc  # noqa: E402


def head(rng: random.Random, n: int) -> tuple[list[Candidate], list[float], float]:
    now = 10.0
    cands = []
    for i in range(n):
        arrival = now - rng.uniform(0, 2)
        cands.append(Candidate(f"q{i}", arrival + rng.choice([0.5, 1.0, 2.0, 5.0]), arrival, rng.uniform(0.02, 0.8)))
    return cands, sorted(rng.uniform(0, 0.5) for _ in range(rng.randint(1, 3))), now


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out/slo_order.json")
    args = ap.parse_args()
    tune_gc()
    rows = []
    for window, iterations in [(4, 100), (8, 30), (8, 100), (8, 300), (16, 100), (32, 100)]:
        rng = random.Random(args.seed)
        times_us: list[float] = []
        within = edf_misses = found_misses = 0
        exhaustive = window <= 8
        for k in range(args.heads):
            cands, free, now = head(rng, window)
            t0 = time.perf_counter_ns()
            order = anneal(cands, free, now, iterations, random.Random(k))
            times_us.append((time.perf_counter_ns() - t0) / 1000)
            got = schedule_cost(order, free, now)
            edf = sorted(cands, key=lambda c: (c.deadline, c.arrival, c.request_id))
            edf_misses += schedule_cost(edf, free, now)[0]
            found_misses += got[0]
            if exhaustive:
                best = min((schedule_cost(p, free, now) for p in itertools.permutations(cands)),
                           key=lambda c: (c[0], c[1]))
                within += got[0] == best[0] and got[1] <= 1.01 * best[1]
        rows.append({
            "window": window, "iterations": iterations, "heads": args.heads,
            "decision_us_p50": round(percentile(times_us, 0.5), 1), "decision_us_p99": round(percentile(times_us, 0.99), 1),
            "within_1pct_of_exhaustive": round(within / args.heads, 4) if exhaustive else None,
            "misses_per_head_edf": round(edf_misses / args.heads, 3),
            "misses_per_head_annealed": round(found_misses / args.heads, 3),
        })
        print(rows[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print("| window | iterations | decision p50 µs | decision p99 µs | within 1% of exhaustive | misses per head, EDF → annealed |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        w = "–" if r["within_1pct_of_exhaustive"] is None else f"{r['within_1pct_of_exhaustive']:.1%}"
        print(f"| {r['window']} | {r['iterations']} | {r['decision_us_p50']} | {r['decision_us_p99']} | {w} | "
              f"{r['misses_per_head_edf']} → {r['misses_per_head_annealed']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
