"""Benchmark reports: DIR/results.json, DIR/results.md (a markdown table) and PNG plots
(TTFT CDF, SLO attainment vs rate with the goodput, per-replica load over time)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = ("goodput", "slo_attainment", "ttft_p50", "ttft_p90", "ttft_p99", "e2e_p90", "prefix_hit_rate",
           "throughput", "load_cv", "offloaded_share")


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def markdown_table(systems: dict[str, dict[str, Any]], columns: Sequence[str] = COLUMNS) -> str:
    cols = [c for c in columns if any(c in m for m in systems.values())]
    lines = ["| system | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, m in systems.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(m.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def write_report(out: Path, systems: dict[str, dict[str, Any]], config: dict[str, Any],
                 sweeps: dict[str, list[dict[str, Any]]], ttfts: dict[str, list[float]],
                 load: Sequence[tuple[float, Sequence[int]]] | None = None, load_system: str = "",
                 load_replicas: Sequence[str] = ()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"systems": systems, "config": config, "sweeps": sweeps},
                                                 indent=2, default=str))
    (out / "results.md").write_text(markdown_table(systems) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, vals in ttfts.items():
        if vals:
            s = sorted(v for v in vals if v > 0)
            ax.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=name)
    if config.get("slo_s"):
        ax.axvline(config["slo_s"], color="grey", linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=120)
    plt.close(fig)

    if sweeps:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, pts in sweeps.items():
            g = systems.get(name, {}).get("goodput")
            label = f"{name} (goodput {g:.2f})" if isinstance(g, float) else name
            ax.plot([p["rate"] for p in pts], [p["slo_attainment"] for p in pts], marker="o", label=label)
        ax.axhline(0.9, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "goodput_vs_rate.png", dpi=120)
        plt.close(fig)

    if load:
        fig, ax = plt.subplots(figsize=(6, 4))
        ts = [t for t, _ in load]
        n = len(load[0][1])
        for j in range(n):
            label = load_replicas[j] if j < len(load_replicas) and n <= 8 else None
            ax.plot(ts, [vals[j] for _, vals in load], linewidth=0.6, label=label)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("pending prefill tokens")
        ax.set_title(f"per-replica load: {load_system}")
        if n <= 8:
            ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / "replica_load.png", dpi=120)
        plt.close(fig)
