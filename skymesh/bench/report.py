"""Benchmark reports: results.json, a markdown table, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = ("goodput", "slo_attainment", "ttft_p50", "ttft_p90", "prefix_hit_rate", "throughput", "load_cv",
           "offloaded_share")


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def markdown_table(systems: dict[str, dict[str, Any]]) -> str:
    lines = ["| system | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, m in systems.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(m.get(c)) for c in COLUMNS) + " |")
    return "\n".join(lines)


def write_report(out: Path, systems: dict[str, dict[str, Any]], config: dict[str, Any],
                 sweeps: dict[str, list[dict[str, Any]]], ttfts: dict[str, list[float]],
                 load: list[tuple[float, dict[str, int]]] | None = None, load_system: str = "") -> None:
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
            s = sorted(vals)
            ax.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=name)
    ax.axvline(config.get("slo_s", 0), color="grey", linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("CDF")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in sweeps.items():
        ax.plot([p["rate"] for p in pts], [p["slo_attainment"] for p in pts], marker="o", label=name)
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "goodput_vs_rate.png", dpi=120)
    plt.close(fig)

    if load:
        fig, ax = plt.subplots(figsize=(6, 4))
        rids = sorted(load[0][1]) if load else []
        for rid in rids[:32]:
            ax.plot([t for t, _ in load], [s.get(rid, 0) for _, s in load], linewidth=0.6)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("pending prefill tokens")
        ax.set_title(f"per-replica load: {load_system}")
        fig.tight_layout()
        fig.savefig(out / "replica_load.png", dpi=120)
        plt.close(fig)
