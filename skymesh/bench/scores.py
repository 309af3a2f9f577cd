"""Benchmark metrics, defined once for the live and the discrete-event modes.

- *SLO attainment* (DualMap's effective request capacity at a given load): the share of
  requests whose TTFT met the SLO; failed and rejected requests count as misses.
- *Goodput*: the highest request rate at which at least 90% of requests meet the TTFT SLO,
  from a rate sweep (linear interpolation between the two sweep points around 90%);
  the monotone variant counts a rate only if every lower swept rate passed too.
- TTFT / E2E percentiles: nearest rank, over requests that got a first token / finished.
- Output-token throughput: output tokens of finished requests over the span from the
  first arrival to the last finish.
- Load CV (DualMap): coefficient of variation across replicas of the pending prefill
  tokens, sampled over time, averaged over the samples in which anything is pending.
- Offloaded share: requests served by a region other than the client's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from skymesh.config import SloClassConfig


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if len(values) == 0:
        return None
    s = sorted(values)
    k = max(1, math.ceil(q / 100 * len(s)))
    return float(s[k - 1])


def slo_attainment(ttfts: Iterable[float | None], slo_s: float) -> float:
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


def monotone_goodput(sweep: Sequence[tuple[float, float]], target: float = 0.9) -> float:
    """The highest rate below which *every* swept rate has SLO attainment ≥ ``target``:
    walk up from the lowest rate and stop at the first that fails (interpolating linearly
    between it and the last that passed). Unlike :func:`goodput`, a rate that passes
    again past a failing one does not count, so adding sweep points cannot raise the
    figure over a failure; 0.0 when the lowest rate already fails."""
    best = 0.0
    prev: tuple[float, float] | None = None
    for rate, att in sorted(sweep):
        if att < target:
            if prev is not None:
                r1, a1 = prev
                best = r1 + (rate - r1) * (a1 - target) / (a1 - att)
            return best
        best, prev = rate, (rate, att)
    return best


def cv(values: Sequence[float]) -> float | None:
    """Coefficient of variation (population std / mean); None when the mean is 0."""
    if len(values) == 0:
        return None
    mean = sum(values) / len(values)
    if mean <= 0:
        return None
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return math.sqrt(var) / mean


def load_cv(samples: Iterable[dict[str, int]]) -> float:
    """Mean over samples (replica -> pending prefill tokens) of the CV across replicas;
    samples in which nothing is pending are skipped."""
    cvs = [c for c in (cv(list(s.values())) for s in samples) if c is not None]
    return sum(cvs) / len(cvs) if cvs else 0.0


def _p(arr: np.ndarray, q: float) -> float | None:
    if arr.size == 0:
        return None
    s = np.sort(arr)
    return round(float(s[max(1, math.ceil(q / 100 * s.size)) - 1]), 4)


def summarize_arrays(arrival: np.ndarray, ttft: np.ndarray, e2e: np.ndarray, output_len: np.ndarray,
                     rejected: np.ndarray, offloaded: np.ndarray, slo_s: float, *,
                     prefix_hit_rate: float | None = None, load_cv_value: float | None = None,
                     warmup_s: float = 0.0, itl: np.ndarray | None = None, tbt: np.ndarray | None = None,
                     tbt_slo_s: float | None = None) -> dict[str, Any]:
    """The metric set over per-request arrays (``ttft``/``e2e`` NaN when missing).
    Requests arriving before ``warmup_s`` (after the first arrival) are excluded. With
    ``tbt`` (each request's TBT, NaN when not served) and ``tbt_slo_s``, a request meets
    the SLO only when its TBT is within that target too (Mooncake's two targets)."""
    if arrival.size:
        keep = arrival >= arrival.min() + warmup_s
        arrival, ttft, e2e = arrival[keep], ttft[keep], e2e[keep]
        output_len, rejected, offloaded = output_len[keep], rejected[keep], offloaded[keep]
        if tbt is not None:
            tbt = tbt[keep]
    n = int(arrival.size)
    got = ~np.isnan(ttft)
    fin = ~np.isnan(e2e)
    judged = tbt is not None and tbt_slo_s is not None
    if judged:
        assert tbt is not None and tbt_slo_s is not None
        met = int(np.count_nonzero(got & (np.nan_to_num(ttft, nan=np.inf) <= slo_s)
                                   & (np.nan_to_num(tbt, nan=np.inf) <= tbt_slo_s)))
    else:
        met = int(np.count_nonzero(ttft[got] <= slo_s))
    if fin.any():
        span = max(1e-9, float((arrival[fin] + e2e[fin]).max() - arrival.min()))
        throughput = float(output_len[fin].sum()) / span
    else:
        throughput = 0.0
    out: dict[str, Any] = {
        "requests": n,
        "completed": int(fin.sum()),
        "rejected": int(np.count_nonzero(rejected)),
        "slo_attainment": round(met / n, 4) if n else 0.0,
        "ttft_p50": _p(ttft[got], 50),
        "ttft_p90": _p(ttft[got], 90),
        "ttft_p99": _p(ttft[got], 99),
        "e2e_p50": _p(e2e[fin], 50),
        "e2e_p90": _p(e2e[fin], 90),
        "e2e_p99": _p(e2e[fin], 99),
        "throughput": round(throughput, 2),
        "prefix_hit_rate": None if prefix_hit_rate is None else round(prefix_hit_rate, 4),
        "load_cv": None if load_cv_value is None else round(load_cv_value, 4),
        "offloaded_share": round(float(np.count_nonzero(offloaded)) / n, 4) if n else 0.0,
    }
    if itl is not None:
        out["itl_p50"] = _p(itl, 50)
        out["itl_p99"] = _p(itl, 99)
    if judged:
        assert tbt is not None
        served = tbt[~np.isnan(tbt)]
        out["tbt_p50"] = _p(served, 50)
        out["tbt_p90"] = _p(served, 90)
    return out


def class_summary(arrival: np.ndarray, ttft: np.ndarray, e2e: np.ndarray, output_len: np.ndarray,
                  rejected: np.ndarray, member: np.ndarray, targets: SloClassConfig, *,
                  warmup_s: float = 0.0) -> dict[str, Any]:
    """One SLO class's figures over per-request arrays (``member`` selects its requests;
    ``ttft``/``e2e`` NaN when missing). Attainment: the share of its requests that met
    every target of the class (TTFT; TPOT over the output tokens after the first; end to
    end); a rejected or unfinished request meets none."""
    keep = member & (arrival >= (arrival.min() + warmup_s if arrival.size else 0.0))
    ttft, e2e, out = ttft[keep], e2e[keep], output_len[keep]
    n = int(keep.sum())
    ok = ~np.isnan(e2e) & ~np.isnan(ttft)
    if targets.ttft_s is not None:
        ok &= ttft <= targets.ttft_s
    if targets.tpot_s is not None:
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = (e2e - ttft) / np.maximum(out - 1, 1)
        ok &= (out <= 1) | (tpot <= targets.tpot_s)
    if targets.e2e_s is not None:
        ok &= e2e <= targets.e2e_s
    got, fin = ~np.isnan(ttft), ~np.isnan(e2e)
    return {
        "requests": n,
        "slo_attainment": round(float(ok.sum()) / n, 4) if n else 0.0,
        "rejected_share": round(float(np.count_nonzero(rejected[keep])) / n, 4) if n else 0.0,
        "ttft_mean": round(float(ttft[got].mean()), 4) if got.any() else None,
        "ttft_p90": _p(ttft[got], 90),
        "e2e_mean": round(float(e2e[fin].mean()), 4) if fin.any() else None,
        "e2e_p90": _p(e2e[fin], 90),
    }


def summarize(results: Sequence[Any], slo_s: float, prefix_hit_rate: float | None = None,
              load_samples: Iterable[dict[str, int]] = (), warmup_s: float = 0.0) -> dict[str, Any]:
    """``results``: objects with arrival_s, ttft, e2e, output_len, rejected, offloaded (and
    optionally ``itl``, a list of inter-token gaps)."""

    def arr(vals: Iterable[float | None]) -> np.ndarray:
        return np.array([math.nan if v is None else v for v in vals], dtype=float)

    itls = [g for r in results for g in (getattr(r, "itl", None) or ())]
    samples = list(load_samples)
    return summarize_arrays(
        arr(r.arrival_s for r in results), arr(r.ttft for r in results), arr(r.e2e for r in results),
        np.array([r.output_len for r in results], dtype=float), np.array([bool(r.rejected) for r in results]),
        np.array([bool(r.offloaded) for r in results]), slo_s, prefix_hit_rate=prefix_hit_rate,
        load_cv_value=load_cv(samples) if samples else None, warmup_s=warmup_s,
        itl=np.array(itls, dtype=float) if itls else None,
    )
