"""Benchmark metrics, defined once for the live and the simulated modes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(1, math.ceil(q / 100 * len(s)))
    return s[k - 1]


def slo_attainment(ttfts: Iterable[float | None], slo_s: float) -> float:
    """Share of requests whose TTFT met the SLO; failed/rejected (None) count as misses.
    This is DualMap's *effective request capacity* at a given load."""
    vals = list(ttfts)
    if not vals:
        return 0.0
    return sum(1 for t in vals if t is not None and t <= slo_s) / len(vals)


def goodput(sweep: Sequence[tuple[float, float]], target: float = 0.9) -> float:
    """Highest request rate whose SLO attainment is ≥ ``target``; between two measured
    rates that bracket the target it interpolates linearly. ``sweep``: (rate, attainment)."""
    pts = sorted(sweep)
    best = 0.0
    for i, (rate, att) in enumerate(pts):
        if att >= target:
            best = max(best, rate)
            if i + 1 < len(pts) and pts[i + 1][1] < target:
                r2, a2 = pts[i + 1]
                best = max(best, rate + (r2 - rate) * (att - target) / (att - a2))
    return best


def load_cv(samples: Iterable[dict[str, int]]) -> float:
    """DualMap's load imbalance: coefficient of variation of pending prefill tokens across
    replicas, averaged over the samples in which anything is pending."""
    cvs = []
    for snap in samples:
        vals = list(snap.values())
        if not vals:
            continue
        mean = sum(vals) / len(vals)
        if mean <= 0:
            continue
        var = sum((v - mean) ** 2 for v in vals) / len(vals)
        cvs.append(math.sqrt(var) / mean)
    return sum(cvs) / len(cvs) if cvs else 0.0


def summarize(results: Sequence[Any], slo_s: float, prefix_hit_rate: float | None = None,
              load_samples: Iterable[dict[str, int]] = ()) -> dict[str, Any]:
    """results: objects with arrival_s, ttft, e2e, output_len, rejected, offloaded."""
    ttfts = [r.ttft for r in results]
    ok = [t for t in ttfts if t is not None]
    e2es = [r.e2e for r in results if r.e2e is not None]
    finished = [r for r in results if r.e2e is not None]
    start = min((r.arrival_s for r in results), default=0.0)
    end = max((r.arrival_s + r.e2e for r in finished), default=start)
    span = max(1e-9, end - start)
    return {
        "requests": len(results),
        "completed": len(finished),
        "rejected": sum(1 for r in results if r.rejected),
        "slo_attainment": round(slo_attainment(ttfts, slo_s), 4),
        "ttft_p50": percentile(ok, 50),
        "ttft_p90": percentile(ok, 90),
        "ttft_p99": percentile(ok, 99),
        "e2e_p50": percentile(e2es, 50),
        "e2e_p90": percentile(e2es, 90),
        "e2e_p99": percentile(e2es, 99),
        "throughput": round(sum(r.output_len for r in finished) / span, 2),
        "prefix_hit_rate": None if prefix_hit_rate is None else round(prefix_hit_rate, 4),
        "load_cv": round(load_cv(load_samples), 4),
        "offloaded_share": round(sum(1 for r in results if r.offloaded) / len(results), 4) if results else 0.0,
    }
