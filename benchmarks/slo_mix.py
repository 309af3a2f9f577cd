"""Mixed SLO classes in the discrete-event mode: per-class attainment and mean latency of
queue disciplines at the same load, and early rejection on vs off (issue "Many SLOs").

The conversation trace's first ``--requests`` requests on 8 ``h100-qwen2.5-7b`` stand-ins
(dualmap), each session drawn chat (70%) or batch (30%) with the classes of
``benchmarks/classes/mixed.yaml`` (chat: TTFT 1 s + TPOT 0.1 s; batch: end to end 60 s),
seeds 0, 1, 2 (the seed draws the classes), at rate multipliers around saturation.
Configurations: ``fcfs`` (arrival order), ``slo`` (the annealed head window), ``priority``
(chat one priority above batch, FCFS within), each with early rejection; and ``slo`` /
``fcfs`` without it.

    .venv/bin/python -m benchmarks.slo_mix [--rates 4,5,6] [--jobs 2] [--out FILE.json] [--png FIG.png]
    .venv/bin/python -m benchmarks.slo_mix --replot FILE.json --png FIG.png
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skymesh.bench import sim_main, sim_setup  # noqa: E402
from skymesh.bench.figures import load_json, slo_mix_figure  # noqa: E402

HERE = Path(__file__).resolve().parent
MIXED = HERE / "classes" / "mixed.yaml"
CONFIGS: dict[str, tuple[str, list[str]]] = {
    # label -> (classes file, extra sim arguments)
    "fcfs": ("mixed", []),
    "slo": ("mixed", ["--queue-discipline", "slo"]),
    "priority (chat first)": ("priority", []),
    "fcfs, no early rejection": ("mixed", ["--no-early-rejection"]),
    "slo, no early rejection": ("mixed", ["--queue-discipline", "slo", "--no-early-rejection"]),
}


def classes_file(kind: str, tmp: Path) -> Path:
    if kind == "mixed":
        return MIXED
    path = tmp / "priority.yaml"
    path.write_text("slo_classes:\n  chat: {ttft_s: 1.0, tpot_s: 0.1, priority: 1}\n  batch: {e2e_s: 60.0}\n")
    return path


def one(label: str, seed: int, rates: str, requests: int, tmp: str) -> dict[str, Any]:
    kind, extra = CONFIGS[label]
    out = Path(tmp) / f"{label}-{seed}".replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
    p = argparse.ArgumentParser()
    sim_setup.add_arguments(p)
    args = p.parse_args(["--first-n", str(requests), "--replicas", "8", "--systems", "dualmap", "--rates", rates,
                         "--seed", str(seed), "--jobs", "1", "--slo-classes", str(classes_file(kind, Path(tmp))),
                         "--slo-mix", "chat=0.7,batch=0.3", "--out", str(out), *extra])
    sim_main.run(args)
    sweep = json.loads((out / "results.json").read_text())["sweeps"]["dualmap"]
    return {"label": label, "seed": seed, "points": [
        {"rate_multiplier": m["rate_multiplier"], "classes": m["classes"], "rejected": m["rejected"],
         "requests": m["requests"]} for m in sweep]}


def col(pts: list[dict[str, Any]], cls: str, key: str) -> str:
    """One class's figure at each seed, "a / b / c"."""
    return " / ".join("–" if p["classes"][cls][key] is None else f"{p['classes'][cls][key]:.3g}" for p in pts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="4,5,6")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="bench-out/slo_mix.json")
    ap.add_argument("--png", default=None, metavar="PATH",
                    help="also draw the results page's figure (each class's attainment per rate) to PATH")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="run nothing: draw --png from a JSON this command wrote earlier")
    args = ap.parse_args(argv)
    if args.replot:
        if not args.png:
            raise SystemExit("--replot: name the figure's file with --png PATH")
        print(f"wrote {slo_mix_figure(load_json(args.replot), Path(args.png))}")
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    check = argparse.ArgumentParser(prog="benchmarks.slo_mix")
    sim_setup.add_arguments(check)
    check.parse_args([])  # the conversation trace missing: one error here, not one per worker
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs) as pool:
        futs = [pool.submit(one, label, s, args.rates, args.requests, tmp) for label in CONFIGS for s in seeds]
        runs = [f.result() for f in futs]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(runs, indent=1))
    print("| configuration | rate | chat attainment (seeds) | batch attainment (seeds) | chat mean TTFT s | batch mean e2e s | rejected |")
    print("|---|---|---|---|---|---|---|")
    for label in CONFIGS:
        mine = [r for r in runs if r["label"] == label]
        for k, rate in enumerate(args.rates.split(",")):
            pts = [r["points"][k] for r in mine]

            rej = " / ".join(str(p["rejected"]) for p in pts)
            print(f"| {label} | x{rate} | {col(pts, 'chat', 'slo_attainment')} | {col(pts, 'batch', 'slo_attainment')} | "
                  f"{col(pts, 'chat', 'ttft_mean')} | {col(pts, 'batch', 'e2e_mean')} | {rej} |")
    if args.png:
        print(f"wrote {slo_mix_figure(runs, Path(args.png))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
