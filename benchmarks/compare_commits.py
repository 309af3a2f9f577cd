"""Two commits on the project's routing days: goodput side by side (issue 36's guard).

The same days, the same seeds, the same search on this tree and on a named baseline
commit (checked out into a temporary git worktree, removed on the way out): per day and
seed, each tree's goodput by bisection (its own ``skymesh.bench.ranking.bisect_goodput``
over its own ``skymesh sim`` runs), the ratio this tree / baseline, and the offloaded
share, prefix hit rate and P90 TTFT at each goodput. Every simulation runs in a child
process with ``PYTHONPATH`` naming its tree, so each tree is measured by its own code.

The days (3 regions, one-way 40/80/110 ms, 3 replicas per region, ``dualmap`` with
predicted-TTFT offload, TTFT SLO 2 s; short enough for a 2-core box):

- ``geo``: the conversation trace's first 20 minutes, sessions even, peaks a third of a
  period apart, EU rule ("Geo: a balanced diurnal day");
- ``balanced``, ``close-peaks``, ``one-big-region``: benchmarks/three_days.py's windows and
  shapes, no residency rule (as ``skymesh plan --no-eu-rule`` runs them);
- ``hot-prefix``: the hot-prefix workload (4000 requests, 20 req/s), no residency rule;
- ``held-out``: a day of the held-out shape (issue 36) drawn by this tree's synthetic
  stream and written as a trace both trees replay (benchmarks/write_workload.py): 12,000
  requests over ~10 minutes, a cosine diurnal period of 600 s (peak 5x trough) peaking 8
  "hours" apart, turns up to 12 (3 on average) with growing history, 5 system prompts per
  region of 1-4 blocks, 2.5% of conversations on a prefix every region shares; no
  residency rule. The baseline needs none of the options that drew it.

    PYTHONPATH=. .venv/bin/python benchmarks/compare_commits.py --baseline 8553f55 \\
        [--days geo,balanced,...] [--seeds 0,1] [--jobs 2] [--out bench-out/compare]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from benchmarks.three_days import DAYS as THREE_DAYS  # noqa: E402
from skymesh.bench.traces import DEFAULT_TRACE  # noqa: E402

MESH = ["--regions", "3", "--replicas", "3", "--slo", "2", "--systems", "dualmap"]
PERIOD = ["--diurnal-period-s", "1200", "--duration-s", "1200"]
HELD_OUT_DAY = ["--trace", "synthetic", "--regions", "3", "--requests", "12000", "--rate", "33",
                "--diurnal-period-s", "600", "--amplitude", "0.8", "--turns-mean", "3", "--max-turns", "12",
                "--region-system-prompts", "5", "--system-prompt-blocks", "1-4", "--shared-prefix-share", "0.025"]
# day -> the sim arguments (the trace: "{trace}" for the conversation trace, "{held_out}"
# for the held-out day's file of the seed)
DAYS: dict[str, list[str]] = {
    "geo": ["--trace", "{trace}", *PERIOD, "--start-s", "0"],
    **{name: ["--trace", "{trace}", *PERIOD, *shape, "--no-eu-rule"] for name, (shape, _) in THREE_DAYS.items()},
    "hot-prefix": ["--trace", "hot-prefix", "--requests", "4000", "--rate", "20", "--no-eu-rule"],
    "held-out": ["--trace", "{held_out}", "--diurnal-period-s", "0", "--no-eu-rule"],
}

# runs in a child process inside one tree: that tree's own simulator and bisection
DRIVER = """
import argparse, json, sys
try:
    from skymesh.bench import sim_setup
except ImportError:  # a tree from before sim_setup.py, whose setup lived in sim_main
    from skymesh.bench import sim_main as sim_setup
from skymesh.bench.ranking import bisect_goodput
from skymesh.bench.search_main import base_rate
p = argparse.ArgumentParser()
sim_setup.add_arguments(p)
a = p.parse_args(json.loads(sys.argv[1]))
system = a.systems.split(",")[0]
by = {}
def at(rate):
    m = sim_setup.run_one(a, system, rate, False)["metrics"]
    by[rate] = m
    return float(m["slo_attainment"])
s = bisect_goodput(at, resolution=a.resolution)
m = by.get(s.goodput, {})
print("RESULT " + json.dumps({"multiplier": s.goodput, "base_rate": base_rate(a) or 1.0,
      "offloaded_share": m.get("offloaded_share"), "hit_rate": m.get("prefix_hit_rate"),
      "ttft_p90": m.get("ttft_p90"), "runs": len(s.evaluated)}))
"""


def day_args(day: str, seed: int, resolution: float, held_out: dict[int, Path]) -> list[str]:
    args = [a.replace("{trace}", DEFAULT_TRACE).replace("{held_out}", str(held_out.get(seed, "")))
            for a in DAYS[day]]
    return [*MESH, *args, "--seed", str(seed), "--resolution", str(resolution), "--jobs", "1", "--out",
            os.devnull]


def search(tree: Path, argv: list[str], log: Path) -> dict[str, Any]:
    """One goodput search by ``tree``'s code; its output kept in ``log``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = ["nice", sys.executable, "-c", DRIVER, json.dumps(argv)]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(" ".join(argv) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: search failed (exit {proc.returncode}), see {log}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    r["goodput"] = r["multiplier"] * r["base_rate"]
    return r


def write_held_out(seed: int, out: Path) -> Path:
    path = out / f"held-out-seed{seed}.jsonl"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "benchmarks.write_workload", *HELD_OUT_DAY, "--seed", str(seed),
                        "--out", str(path)], cwd=HERE, env={**os.environ, "PYTHONPATH": str(HERE)}, check=True,
                       capture_output=True)
    return path


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the commit to compare this tree with")
    ap.add_argument("--days", default=",".join(DAYS), help=f"comma-separated, of: {', '.join(DAYS)}")
    ap.add_argument("--seeds", default="0", help="comma-separated arrival seeds")
    ap.add_argument("--resolution", type=float, default=0.05, help="goodput search: relative bracket width")
    ap.add_argument("--jobs", type=int, default=2, help="searches at once")
    ap.add_argument("--out", default="bench-out/compare")
    cli = ap.parse_args()
    days = [d for d in cli.days.split(",") if d]
    unknown = [d for d in days if d not in DAYS]
    if unknown:
        raise SystemExit(f"--days: unknown {', '.join(unknown)} (known: {', '.join(DAYS)})")
    seeds = [int(s) for s in cli.seeds.split(",") if s.strip()]
    out = Path(cli.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                                capture_output=True, text=True, check=True).stdout.strip())
    this = head + ("+changes" if dirty else "")
    held_out = {s: write_held_out(s, out) for s in seeds} if "held-out" in days else {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="skymesh-baseline-") as tmp:
        base_tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), cli.baseline], cwd=HERE, check=True,
                       capture_output=True)
        try:
            trees = {"this": HERE, "baseline": base_tree}
            jobs = [(day, seed, name) for day in days for seed in seeds for name in trees]
            with ThreadPoolExecutor(max_workers=max(1, cli.jobs)) as pool:
                futs = {job: pool.submit(search, trees[job[2]], day_args(job[0], job[1], cli.resolution, held_out),
                                         out / "logs" / f"{job[0]}-seed{job[1]}-{job[2]}.log") for job in jobs}
                results = {job: f.result() for job, f in futs.items()}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=HERE, capture_output=True)
    lines = [f"this tree {this} vs baseline {cli.baseline}; resolution {cli.resolution:.0%}; "
             f"goodput = the highest load with SLO attainment >= 0.9 at TTFT 2 s",
             "", "| day | seed | goodput this (req/s) | goodput baseline | ratio | offloaded share this / baseline "
             "| hit rate this / baseline | P90 TTFT this / baseline (s) |", "|---|---|---|---|---|---|---|---|"]
    rows = []
    for day in days:
        for seed in seeds:
            a, b = results[(day, seed, "this")], results[(day, seed, "baseline")]
            ratio = a["goodput"] / b["goodput"] if b["goodput"] else None
            rows.append({"day": day, "seed": seed, "this": a, "baseline": b, "ratio": ratio})
            lines.append(f"| {day} | {seed} | {a['goodput']:.1f} | {b['goodput']:.1f} | {fmt(ratio, '.3f')} | "
                         f"{fmt(a['offloaded_share'], '.3f')} / {fmt(b['offloaded_share'], '.3f')} | "
                         f"{fmt(a['hit_rate'], '.3f')} / {fmt(b['hit_rate'], '.3f')} | "
                         f"{fmt(a['ttft_p90'], '.2f')} / {fmt(b['ttft_p90'], '.2f')} |")
    report = "\n".join(lines)
    (out / "compare.json").write_text(json.dumps({"this": this, "baseline": cli.baseline, "days": days,
                                                  "seeds": seeds, "resolution": cli.resolution, "rows": rows,
                                                  "wall_s": round(time.perf_counter() - t0, 1)}, indent=1))
    (out / "compare.md").write_text(report + "\n")
    print(report)
    print(f"wrote {out}/compare.json, compare.md ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
