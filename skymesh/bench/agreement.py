"""`skymesh bench agree ...`: the live and the discrete-event modes on the same trace slice.

Runs ``skymesh sim`` and ``skymesh bench --trace`` with the same first-N requests, replica
count, profile, SLO and rate sweep, then compares them system by system: goodput, SLO
attainment at every rate, and the ranking by goodput (Kendall's tau over the systems both
modes ran). Peer routers (``sglang-router``, ``vllm-router``) exist only live: they are
reported beside the ranking, with skymesh's goodput as a ratio over each of them.

Writes ``DIR/sim/``, ``DIR/live/`` (each a full report) and ``DIR/agreement.md`` +
``DIR/agreement.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from skymesh.bench.peers import PEERS
from skymesh.bench.trace_args import trace_argument
from skymesh.bench.traces import DEFAULT_TRACE


def ranking(goodputs: Mapping[str, float]) -> list[str]:
    """Systems by goodput, best first (ties by name, so the order is deterministic)."""
    return sorted(goodputs, key=lambda s: (-goodputs[s], s))


def kendall_tau(a: Mapping[str, float], b: Mapping[str, float]) -> float | None:
    """Kendall's tau-a between two scorings of the same systems: +1 same order, -1
    reversed; a pair tied in either scoring counts as neither concordant nor discordant.
    None with fewer than two common systems."""
    common = sorted(set(a) & set(b))
    n = len(common)
    if n < 2:
        return None
    score = 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = common[i], common[j]
            da = a[x] - a[y]
            db = b[x] - b[y]
            if da * db > 0:
                score += 1
            elif da * db < 0:
                score -= 1
    return score / (n * (n - 1) / 2)


def compare(live: Mapping[str, Any], sim: Mapping[str, Any], reference: str = "dualmap") -> dict[str, Any]:
    """Side-by-side rows from two results.json documents (``{"systems", "sweeps", ...}``)."""
    live_sys, sim_sys = live.get("systems", {}), sim.get("systems", {})
    scale = float(live.get("config", {}).get("time_scale", 1.0))
    shared = [s for s in sim_sys if s in live_sys]
    rows = []
    for s in shared:
        rows.append({
            "system": s,
            "goodput_live": live_sys[s]["goodput"],
            "goodput_sim": sim_sys[s]["goodput"],
            "attainment_live": [p["slo_attainment"] for p in live.get("sweeps", {}).get(s, [])],
            "attainment_sim": [p["slo_attainment"] for p in sim.get("sweeps", {}).get(s, [])],
            # live TTFTs are wall seconds at the replicas' time scale; back to trace time
            "ttft_p50_live": None if live_sys[s].get("ttft_p50") is None else live_sys[s]["ttft_p50"] / scale,
            "ttft_p50_sim": sim_sys[s].get("ttft_p50"),
        })
    g_live = {r["system"]: r["goodput_live"] for r in rows}
    g_sim = {r["system"]: r["goodput_sim"] for r in rows}
    peers = {}
    ref = live_sys.get(reference, {}).get("goodput")
    for p in PEERS:
        if p in live_sys:
            g = live_sys[p]["goodput"]
            peers[p] = {"goodput_live": g, "reference_over_peer": (ref / g) if ref is not None and g else None}
    return {"rows": rows, "ranking_live": ranking(g_live), "ranking_sim": ranking(g_sim),
            "kendall_tau": kendall_tau(g_live, g_sim), "peers": peers, "reference": reference}


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.2f}"
    if isinstance(v, list):
        return " ".join(f"{x:.2f}" for x in v)
    return str(v)


def agreement_markdown(c: Mapping[str, Any]) -> str:
    lines = ["| system | goodput live | goodput sim | attainment live | attainment sim | TTFT p50 live | "
             "TTFT p50 sim | rank live | rank sim |", "|---|---|---|---|---|---|---|---|---|"]
    rl, rs = c["ranking_live"], c["ranking_sim"]
    for r in c["rows"]:
        s = r["system"]
        lines.append(f"| {s} | {_fmt(r['goodput_live'])} | {_fmt(r['goodput_sim'])} | "
                     f"{_fmt(r['attainment_live'])} | {_fmt(r['attainment_sim'])} | "
                     f"{_fmt(r['ttft_p50_live'])} | {_fmt(r['ttft_p50_sim'])} | "
                     f"{rl.index(s) + 1} | {rs.index(s) + 1} |")
    lines.append("")
    lines.append(f"Kendall's tau (goodput ranking, live vs sim): {_fmt(c['kendall_tau'])}")
    for p, v in c["peers"].items():
        lines.append(f"{p} (live only): goodput {_fmt(v['goodput_live'])}; "
                     f"{c['reference']} / {p} = {_fmt(v['reference_over_peer'])}")
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=DEFAULT_TRACE, type=trace_argument(p.prog),
                   help="Mooncake JSONL trace (default: the Mooncake conversation trace in ../shared/traces/, "
                        "not part of the repository)")
    p.add_argument("--systems", default="dualmap,prefix_tree,cache_aware,round_robin",
                   help="registry policies run in both modes")
    p.add_argument("--peers", default="sglang-router,vllm-router", help="live-only peer routers ('' for none)")
    p.add_argument("--requests", type=int, default=600, help="the first N trace requests, in both modes")
    p.add_argument("--rates", default="2,3,4,5")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--profile", default="h100-qwen2.5-7b")
    p.add_argument("--slo", type=float, default=2.0)
    p.add_argument("--time-scale", type=float, default=1.0, help="live replicas' speed-up (see skymesh bench)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--out", default="bench-out/agreement")


def _sub_args(module: Any, argv: Sequence[str]) -> argparse.Namespace:
    sp = argparse.ArgumentParser()
    module.add_arguments(sp)
    return sp.parse_args(list(argv))


def run(args: argparse.Namespace) -> int:
    # lazy: `skymesh bench` imports every mode's module for its parser; only a run loads the simulator
    from skymesh.bench import live, sim_main

    out = Path(args.out)
    common = ["--trace", args.trace, "--replicas", str(args.replicas), "--profile", args.profile,
              "--slo", str(args.slo), "--rates", args.rates]
    sim_args = _sub_args(sim_main, [*common, "--systems", args.systems, "--first-n", str(args.requests),
                                    "--jobs", "1", "--out", str(out / "sim")])
    sim_main.run(sim_args)
    live_systems = ",".join(s for s in [*args.systems.split(","), *args.peers.split(",")] if s)
    live_args = _sub_args(live, [*common, "--systems", live_systems, "--requests", str(args.requests),
                                 "--time-scale", str(args.time_scale), "--timeout-s", str(args.timeout_s),
                                 "--out", str(out / "live")])
    live.run(live_args)
    c = compare(json.loads((out / "live" / "results.json").read_text()),
                json.loads((out / "sim" / "results.json").read_text()))
    (out / "agreement.json").write_text(json.dumps(c, indent=2))
    md = agreement_markdown(c)
    (out / "agreement.md").write_text(md)
    print(md)
    return 0
