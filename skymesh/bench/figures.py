"""The results page's figures (docs/results.md), each drawn from the results JSON its
benchmark command writes, so a rerun of the command, or a replot of a JSON it wrote
earlier (`--replot FILE --png OUT`), redraws it:

- :func:`peers_figure`: `skymesh bench` (live trace replay) ``results.json``: SLO
  attainment per rate and goodput per router;
- :func:`geo_figure`: ``benchmarks.three_days``'s ``three_days.json``: replicas each plan
  needs and the mesh's saving against the pooled bound's and the day's shape ceiling;
- :func:`fleet_figure`: ``benchmarks.fleet_capacity --json``: balancer CPU per request
  and requests/s at saturation with 1, 2, 3 balancers per region;
- :func:`slo_mix_figure`: ``benchmarks.slo_mix``'s JSON: each class's attainment per rate;
- :func:`pd_figure`: ``benchmarks.pd_split``'s JSON (several merged): goodput over
  aggregated's per workload.

Agg backend, PNG at 110 dpi, as skymesh plan's figure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

DPI = 110
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)
    return path


def load_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


# ----------------------------------------------------------------------------- routing vs the peers


def peers_figure(results: Mapping[str, Any], path: Path) -> Path:
    """`skymesh bench`'s results.json: attainment against the rate multiplier per system
    (the 0.9 line is the goodput's), and each system's goodput (req/s, monotone rule)."""
    plt = _pyplot()
    sweeps: Mapping[str, Sequence[Mapping[str, Any]]] = results["sweeps"]
    systems: Mapping[str, Mapping[str, Any]] = results.get("systems", {})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    for name, pts in sweeps.items():
        ax.plot([p["rate_multiplier"] for p in pts], [p["slo_attainment"] for p in pts], marker="o", label=name)
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("rate (x the trace's)")
    ax.set_ylabel(f"SLO attainment (TTFT <= {results.get('config', {}).get('slo_s', 2):g} s)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    names = list(sweeps)
    goodput = [float(systems.get(n, {}).get("goodput") or 0.0) for n in names]
    bars = bx.bar(range(len(names)), goodput, color=[f"C{i}" for i in range(len(names))])
    for b, g in zip(bars, goodput, strict=True):
        bx.annotate(f"{g:.2f}", (b.get_x() + b.get_width() / 2, g), ha="center", va="bottom", fontsize=8)
    bx.set_xticks(range(len(names)), names, fontsize=8, rotation=15)
    bx.set_ylabel("goodput (req/s)")
    cfg = results.get("config", {})
    fig.suptitle(f"live: {cfg.get('requests', '?')} requests of the conversation trace, "
                 f"{cfg.get('replicas', '?')} {cfg.get('profile', '')} stand-ins", fontsize=10)
    return _save(fig, path)


# ----------------------------------------------------------------------------- geo savings


def _day_label(r: Mapping[str, Any]) -> str:
    return f"{r['day']}\nseed {r['seed']}, x{r['rate_multiplier']:g}"


def geo_figure(results: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """three_days.json: per day and seed, the replicas region-local, the mesh (no rule),
    the pooled bound and the mesh under the EU rule need; and the mesh's saving against the
    pooled bound's saving and the day's shape ceiling (the peak of the summed load against
    the sum of the regions' peaks)."""
    plt = _pyplot()
    done = [r for r in results if "error" not in r]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = np.arange(len(done))
    series = [("region-local", lambda r: r["free"]["plans"]["region-local"]),
              ("mesh, no rule", lambda r: r["free"]["plans"]["mesh"]),
              ("pooled bound", lambda r: r["free"]["plans"].get("pooled bound")),
              ("mesh, EU rule", lambda r: r["eu"]["plans"]["mesh"] if "eu" in r else None)]
    width = 0.8 / len(series)
    for i, (label, get) in enumerate(series):
        vals = [sum(lay.values()) if (lay := get(r)) else 0 for r in done]
        ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=label)
    ax.set_xticks(x, [_day_label(r) for r in done], fontsize=7)
    ax.set_ylabel("replicas (all regions)")
    ax.legend(fontsize=7)
    ax.set_title("replicas each plan needs", fontsize=9)

    def pooled_saving(r: Mapping[str, Any]) -> float:
        lay = r["free"]["plans"].get("pooled bound")
        local = sum(r["free"]["plans"]["region-local"].values())
        return 1 - sum(lay.values()) / local if lay else 0.0

    shares = [("mesh, no rule", lambda r: r["free"]["mesh_saving"]), ("pooled bound", pooled_saving),
              ("shape ceiling", lambda r: r["free"].get("shape_ceiling") or 0.0)]
    width = 0.8 / len(shares)
    for i, (label, get) in enumerate(shares):
        vals = [100 * get(r) for r in done]
        bx.bar(x + (i - (len(shares) - 1) / 2) * width, vals, width, label=label,
               color=["C1", "C2", "grey"][i])
    bx.set_xticks(x, [_day_label(r) for r in done], fontsize=7)
    bx.set_ylabel("fewer replicas than region-local (%)")
    bx.legend(fontsize=7)
    bx.set_title("the mesh's saving, the pooled bound's, the day's shape ceiling", fontsize=9)
    fig.suptitle("skymesh plan on three days of different shape (DES)", fontsize=10)
    return _save(fig, path)


# ----------------------------------------------------------------------------- fleet scaling


def _fleet_windows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The windows every run has: the moderate rate, each further open-loop rate
    (``open_RATE``), saturation."""
    keys = {k for r in report["runs"] for k in r}
    opened = sorted((k for k in keys if k.startswith("open_")), key=lambda k: float(k.removeprefix("open_")))
    windows = [("moderate", f"open loop, {report.get('args', {}).get('rate', 100):g} req/s")]
    windows += [(k, f"open loop, {k.removeprefix('open_')} req/s") for k in opened]
    return windows + [("saturation", "closed loop, saturation")]


def fleet_figure(report: Mapping[str, Any], path: Path) -> Path:
    """fleet_capacity's JSON: the members' CPU per request in each window, and requests/s at
    saturation, against the balancers per region (every round a point, the line its mean)."""
    plt = _pyplot()
    runs: Sequence[Mapping[str, Any]] = report["runs"]
    ns = sorted({int(r["balancers"]) for r in runs})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for i, (key, label) in enumerate(_fleet_windows(report)):
        per_n = {n: [r[key]["cpu_us_per_request"] for r in runs if r["balancers"] == n and key in r] for n in ns}
        have = [n for n in ns if per_n[n]]
        if not have:
            continue
        ax.plot(have, [float(np.mean(per_n[n])) for n in have], marker="o", color=f"C{i}", label=label)
        for n in have:
            ax.scatter([n] * len(per_n[n]), per_n[n], color=f"C{i}", s=10, alpha=0.5)
    ax.set_xticks(ns)
    ax.set_xlabel("balancers in the region")
    ax.set_ylabel("balancer CPU per request (µs, all members)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    sat = {n: [r["saturation"]["rps"] for r in runs if r["balancers"] == n and "saturation" in r] for n in ns}
    have = [n for n in ns if sat[n]]
    bx.bar(have, [float(np.mean(sat[n])) for n in have], color="C3", alpha=0.7)
    for n in have:
        bx.scatter([n] * len(sat[n]), sat[n], color="black", s=12, zorder=3)
    bx.set_xticks(ns)
    bx.set_xlabel("balancers in the region")
    bx.set_ylabel("requests/s at saturation")
    fig.suptitle("one region as a fleet, live (3 tiny-test stand-ins, streaming, 8 tokens)", fontsize=10)
    return _save(fig, path)


# ----------------------------------------------------------------------------- SLO classes


def slo_mix_figure(runs: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """slo_mix's JSON: each class's attainment against the rate multiplier per configuration
    (the line the mean over the seeds, the band their lowest to highest)."""
    plt = _pyplot()
    labels = list(dict.fromkeys(r["label"] for r in runs))
    classes = sorted({c for r in runs for p in r["points"] for c in p["classes"]})
    fig, axes = plt.subplots(1, len(classes), figsize=(5 * len(classes), 4), squeeze=False)
    for ax, cls in zip(axes[0], classes, strict=True):
        for i, label in enumerate(labels):
            mine = [r for r in runs if r["label"] == label]
            rates = [p["rate_multiplier"] for p in mine[0]["points"]]
            vals = np.array([[p["classes"][cls]["slo_attainment"] for p in r["points"]] for r in mine], dtype=float)
            style = "--" if "no early rejection" in label else "-"
            ax.plot(rates, vals.mean(axis=0), style, marker="o", color=f"C{i}", label=label)
            ax.fill_between(rates, vals.min(axis=0), vals.max(axis=0), color=f"C{i}", alpha=0.12)
        ax.set_title(f"{cls} requests", fontsize=9)
        ax.set_xlabel("rate (x the trace's)")
        ax.set_ylabel("SLO attainment (a rejected request is a miss)")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
    fig.suptitle("mixed SLO classes (DES): queue order and early rejection", fontsize=10)
    return _save(fig, path)


# ----------------------------------------------------------------------------- prefill/decode


def merge_pd_results(parts: Iterable[Sequence[Mapping[str, Any]]]) -> list[Mapping[str, Any]]:
    """pd_split results from several runs as one list: a later run's (system, workload,
    seed) replaces an earlier one's."""
    merged: dict[tuple[str, str, int], Mapping[str, Any]] = {}
    for part in parts:
        for r in part:
            merged[(r["system"], r["workload"], int(r["seed"]))] = r
    return list(merged.values())


def pd_figure(results: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """pd_split's JSON: each system's goodput over aggregated's, per workload (the bar the
    mean of the per-seed ratios, the whisker their lowest to highest)."""
    plt = _pyplot()
    good = {(r["system"], r["workload"], int(r["seed"])): float(r["goodput"]) for r in results}
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    systems = [s for s in dict.fromkeys(r["system"] for r in results) if s != "aggregated"]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.8 / max(1, len(systems))
    x = np.arange(len(workloads))
    for i, s in enumerate(systems):
        means, lo, hi = [], [], []
        for w in workloads:
            ratios = [g / good[("aggregated", w, seed)] for (sys_, w_, seed), g in good.items()
                      if sys_ == s and w_ == w and good.get(("aggregated", w, seed))]
            m = float(np.mean(ratios)) if ratios else 0.0
            means.append(m)
            lo.append(m - min(ratios) if ratios else 0.0)
            hi.append(max(ratios) - m if ratios else 0.0)
        ax.bar(x + (i - (len(systems) - 1) / 2) * width, means, width, yerr=[lo, hi], capsize=2, label=s,
               color=plt.get_cmap("tab20")(i % 20))
    ax.axhline(1.0, color="black", linewidth=0.8, label="aggregated")
    ax.set_xticks(x, workloads)
    ax.set_ylabel("goodput ÷ aggregated's (TTFT <= 2 s and TBT <= 0.1 s)")
    ax.legend(fontsize=7, ncol=2)
    fig.suptitle("prefill/decode pairs (DES): 8 replicas, splits and pair rules against aggregated", fontsize=10)
    return _save(fig, path)
