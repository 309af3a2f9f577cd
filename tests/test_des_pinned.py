"""The discrete-event simulator's results, pinned: a small ranking matrix and a small geo
day, every figure the simulator reports compared with tests/golden/des_pinned.json.

What runs (``CASES``, each through the benchmarks' own path, :func:`sim_setup.run_one` /
:func:`search_main.search_one`, as benchmarks/ranking_matrix.py and benchmarks/geo_day.py
call it):

* the ranking matrix, small: the hot-prefix workload (300 requests, 4 replicas behind one
  balancer) for dualmap, dualmap with ``wait_for_faster_candidate=false``, prefix_tree
  and min_ttft, dualmap behind the fcfs / slo / prefix queue disciplines with SLO classes,
  the KV-event cache view, Tree-of-Thoughts, and one goodput bisection per workload;
* the geo day, small: hot-prefix sessions over us-east-1 / eu-west-1 / ap-northeast-1 with
  per-region diurnal curves, region-local vs offload (predicted-TTFT and saturated
  triggers), with and without the EU residency rule, and an uneven layout.

Workloads are synthetic and seeded (no trace file), so the run depends on nothing outside
the repository. Compared: every metric of ``run_one`` (attainment, TTFT / E2E quantiles,
counts, throughput, hit rate, load CV, offloaded share, prediction accuracy, simulated
time, event count, per-class figures) exactly as JSON round-trips them, and the SHA-256 of
the per-request TTFT list and of the load series (full float precision: one request's
first token moving by one ulp fails). Only ``wall_s`` / ``cpu_s`` are dropped.

Determinism: every random draw is from a generator seeded by ``--seed``; the block and
chunk hashes are Python's ``hash()`` of ints and tuples of ints, which does not depend on
PYTHONHASHSEED (the golden was checked equal under PYTHONHASHSEED=0 and 12345) but is
CPython's tuple hash: a different interpreter could hash differently. No wall clock enters
a result. A run takes a few seconds of CPU.

Regenerate the golden (from the repository root)::

    PYTHONPATH=. .venv/bin/python -m tests.test_des_pinned --write

Doing so is legitimate only for a deliberate behaviour change of the simulator, the
routing core, a policy, the stand-in's engine or a workload generator, argued (what
changed, why, and the benchmarks' numbers before and after) in docs/benchmarks.md in the
same commit. A refactor that needs a new golden is not behaviour-preserving.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.ranking_matrix import system_args
from skymesh.bench import sim_setup
from skymesh.bench.search_main import search_one

GOLDEN = Path(__file__).resolve().parent / "golden" / "des_pinned.json"
CLASSES = Path(__file__).resolve().parent / "golden" / "des_pinned_classes.yaml"

# ranking matrix: one balancer, 4 H100 stand-ins, hot-prefix traffic (as the matrix's
# hot-prefix workload, 300 requests), run at x10 (past saturation: the policies differ)
MATRIX = ["--trace", "hot-prefix", "--requests", "300", "--rate", "20", "--replicas", "4", "--slo", "2",
          "--seed", "3"]
CLASS_MIX = ["--slo-classes", str(CLASSES), "--slo-mix", "interactive=0.3,chat=0.5,batch=0.2"]
# kv-constrained, small: many long shared contexts on 2 L4 stand-ins, vLLM's block size
KV = ["--trace", "hot-prefix", "--requests", "200", "--rate", "1", "--hot-prompts", "40", "--hot-prompt-blocks",
      "8", "--hot-share", "0.9", "--replicas", "2", "--profile", "l4-llama3.1-8b", "--block-size", "16",
      "--slo", "2", "--warmup-s", "20", "--seed", "1"]
TOT = ["--trace", "tot2", "--requests", "300", "--rate", "20", "--replicas", "4", "--slo", "2", "--seed", "2"]
# geo day, small: three regions, a 60 s "day", 2 replicas per region, run at x8 (offload busy)
DAY = ["--trace", "hot-prefix", "--requests", "600", "--rate", "30", "--regions", "3", "--diurnal-period-s", "60",
       "--replicas", "2", "--slo", "2", "--seed", "0"]

# name -> (arguments, system label as ranking_matrix / geo_day name it, rate multiplier)
CASES: dict[str, tuple[list[str], str, float]] = {
    "matrix/dualmap": (MATRIX, "dualmap", 10.0),
    "matrix/dualmap-nowait": (MATRIX, "dualmap-nowait", 10.0),
    "matrix/prefix_tree": (MATRIX, "prefix_tree", 10.0),
    "matrix/min_ttft": (MATRIX, "min_ttft", 10.0),
    "matrix/dualmap/fcfs+classes": ([*MATRIX, *CLASS_MIX], "dualmap/fcfs", 10.0),
    "matrix/dualmap/slo+classes": ([*MATRIX, *CLASS_MIX], "dualmap/slo", 10.0),
    "matrix/dualmap/prefix+classes": ([*MATRIX, *CLASS_MIX], "dualmap/prefix", 10.0),
    "matrix/prefix_tree/slo+classes": ([*MATRIX, *CLASS_MIX], "prefix_tree/slo", 10.0),
    "kv-constrained/dualmap": (KV, "dualmap", 1.0),
    "kv-constrained/dualmap-events": ([*KV, "--cache-view", "events"], "dualmap", 1.0),
    "tot2/dualmap": (TOT, "dualmap", 10.0),
    "tot2/preble": (TOT, "preble", 10.0),
    "geo/region-local": (DAY, "dualmap@local", 8.0),
    "geo/offload-ttft": (DAY, "dualmap", 8.0),
    "geo/offload-saturated": ([*DAY, "--offload-trigger", "saturated"], "dualmap", 8.0),
    "geo/no-eu-rule": ([*DAY, "--no-eu-rule"], "dualmap", 8.0),
    "geo/eu4": ([*DAY, "--region-replicas", "eu-west-1=3"], "dualmap", 8.0),
}
# name -> (arguments, system label): one goodput bisection each, coarse
SEARCHES: dict[str, tuple[list[str], str]] = {
    "matrix/dualmap": (MATRIX, "dualmap"),
    "geo/offload-ttft": (DAY, "dualmap"),
}
SEARCH_RESOLUTION = 0.25


def _args(argv: list[str], **over: Any) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sim_setup.add_arguments(p)
    return argparse.Namespace(**{**vars(p.parse_args(argv)), "jobs": 1, **over})


def _system(args: argparse.Namespace, label: str) -> tuple[argparse.Namespace, str]:
    # benchmarks/ranking_matrix.py's own label parsing (dualmap-nowait, NAME/DISCIPLINE)
    return system_args(args, label)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def run_case(name: str) -> dict[str, Any]:
    argv, label, rate = CASES[name]
    args, system = _system(_args(argv), label)
    out = sim_setup.run_one(args, system, rate, False)
    # reported since the golden was made (new figures, not a change)
    new = ("max_replica_waiting", "max_replica_unadmitted", "regions")
    metrics = {k: v for k, v in out["metrics"].items() if k not in ("wall_s", "cpu_s", *new)}
    return {"metrics": metrics, "ttfts": {"n": len(out["ttfts"]), "sum": sum(out["ttfts"]),
                                          "sha256": _digest(out["ttfts"])},
            "load": {"samples": len(out["load"]), "replicas": out["load_replicas"], "sha256": _digest(out["load"])}}


def run_search(name: str) -> dict[str, Any]:
    argv, label = SEARCHES[name]
    args, system = _system(_args(argv, resolution=SEARCH_RESOLUTION), label)
    r = search_one(args, system, {"seed": args.seed, "start_s": args.start_s, "duration_s": args.duration_s})
    # max_replica_unadmitted: reported since the golden was made (a new figure)
    return {k: v for k, v in r.items() if k not in ("wall_s", "max_replica_unadmitted")}


def compute() -> dict[str, Any]:
    return {"cases": {n: run_case(n) for n in CASES}, "searches": {n: run_search(n) for n in SEARCHES}}


def _normal(value: Any) -> Any:
    """As the golden file holds it (tuples as lists, floats as JSON round-trips them)."""
    return json.loads(json.dumps(value))


def _golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_simulation_matches_golden(name: str) -> None:
    assert _normal(run_case(name)) == _golden()["cases"][name]


@pytest.mark.parametrize("name", list(SEARCHES))
def test_goodput_search_matches_golden(name: str) -> None:
    assert _normal(run_search(name)) == _golden()["searches"][name]


def test_a_case_run_twice_in_one_process_is_identical() -> None:
    # no state carried from one simulation to the next (caches, registries, generators):
    # what each parametrized case computes does not depend on what ran before it
    first = _normal(run_case("geo/offload-saturated"))
    run_case("matrix/dualmap/slo+classes")
    assert _normal(run_case("geo/offload-saturated")) == first


def test_golden_covers_every_case_and_is_not_degenerate() -> None:
    g = _golden()
    assert set(g["cases"]) == set(CASES) and set(g["searches"]) == set(SEARCHES)
    m = {n: c["metrics"] for n, c in g["cases"].items()}
    # the pinned runs exercise what they are for: policies that differ, SLO misses,
    # offload on the geo day (not off region-local), per-class figures
    assert len({m[n]["slo_attainment"] for n in CASES if n.startswith("matrix/")}) > 1
    assert any(0 < x["slo_attainment"] < 1 for x in m.values())
    assert m["geo/region-local"]["offloaded_share"] == 0
    assert m["geo/offload-ttft"]["offloaded_share"] > 0
    assert all("classes" in m[n] for n in CASES if "classes" in n)


def main() -> None:
    ap = argparse.ArgumentParser(description="compute the pinned results; --write: into the golden file")
    ap.add_argument("--write", action="store_true")
    cli = ap.parse_args()
    data = _normal(compute())
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    if cli.write:
        GOLDEN.write_text(text)
        print(f"wrote {GOLDEN}")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
