"""skymesh plan: the searches over layouts (skymesh/bench/plan.py) and the command over
the simulator (skymesh/bench/plan_main.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from skymesh.bench.plan import Layout, PlanError, Search, plan_region_local, plan_shared
from skymesh.bench.plan_main import shape_ceiling
from skymesh.bench.verdict import StopWhen
from skymesh.cli import main

REGIONS = ["a", "b", "c"]
# each region's own load, in replicas' worth of work
DEMAND = {"a": 5.2, "b": 2.5, "c": 0.7}


def independent(layouts: Sequence[Layout], stop: StopWhen | None = None) -> list[dict[str, float]]:
    """Regions that do not share: a region meets its SLO with at least its own demand."""
    return [{r: 0.95 if lay[r] >= DEMAND[r] else 0.5 for r in lay} for lay in layouts]


def shared(layouts: Sequence[Layout], stop: StopWhen | None = None) -> list[dict[str, float]]:
    """Regions that share: every region meets its SLO while the total covers the total
    demand (8.4) and no region holds under half of its own (its spill costs a link)."""
    out = []
    for lay in layouts:
        ok = sum(lay.values()) >= sum(DEMAND.values()) and all(lay[r] >= DEMAND[r] / 2 for r in lay)
        out.append(dict.fromkeys(lay, 0.95 if ok else 0.6))
    return out


def skymesh(*argv: str) -> object:
    """The command's exit code (an int, or the message it exited with)."""
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code


def test_region_local_finds_each_regions_own_fewest() -> None:
    search = Search(independent)
    assert plan_region_local(search, REGIONS, 0.9, 32) == {"a": 6, "b": 3, "c": 1}
    # bisection, every region at once: a handful of runs, none repeated but the answer,
    # which the bisection ran stopping at its verdicts and the plan runs whole (last)
    keys = [tuple(sorted(lay.items())) for lay, _ in search.trials]
    answer = (("a", 6), ("b", 3), ("c", 1))
    assert len(set(keys)) <= 7 and keys[-1] == answer
    assert sorted(keys[:-1]) == sorted(set(keys[:-1]))


def test_region_local_says_which_region_cannot_be_served() -> None:
    with pytest.raises(PlanError, match="a: 4 replicas"):
        plan_region_local(Search(independent), REGIONS, 0.9, 4)


@pytest.mark.parametrize("batch", [None, 1, 2])
def test_shared_descends_to_the_fewest_in_total(batch: int | None) -> None:
    search = Search(shared)
    start = {"a": 9, "b": 7, "c": 5}  # 21 replicas: strides take the first ones
    got = plan_shared(search, start, 0.9, 32, batch=batch)
    assert sum(got.values()) == 9  # ceil(8.4)
    assert all(got[r] >= DEMAND[r] / 2 for r in REGIONS)
    # the plan was measured to meet the SLO, and every single removal from it to miss
    seen = {tuple(sorted(lay.items())): att for lay, att in search.trials}
    assert min(seen[tuple(sorted(got.items()))].values()) >= 0.9
    for r in REGIONS:
        if got[r] > 1:
            below = dict(got, **{r: got[r] - 1})
            assert min(seen[tuple(sorted(below.items()))].values()) < 0.9
    # strides of one per region while they hold: far fewer runs than one removal per step
    assert len(search.trials) < (sum(start.values()) - 9) * len(REGIONS)


def locked(layouts: Sequence[Layout], stop: StopWhen | None = None) -> list[dict[str, float]]:
    """b's clients may not leave b and need 3 replicas there; a and c share what they have
    and b's spare, each b replica beyond 3 worth two of theirs (b is idle at their peaks)."""
    out = []
    for lay in layouts:
        b_ok = lay["b"] >= 3
        shared_ok = lay["a"] >= 1 and lay["c"] >= 1 and lay["a"] + lay["c"] + 2 * max(0, lay["b"] - 3) >= 4
        out.append({"a": 0.95 if shared_ok else 0.6, "b": (0.91 if lay["b"] == 3 else 0.95) if b_ok else 0.5,
                    "c": 0.95 if shared_ok else 0.6})
    return out


def test_the_plan_does_not_depend_on_the_batch() -> None:
    """--jobs runs removals side by side; the plan is the one the sequential descent finds."""
    plans = [plan_shared(Search(shared), {"a": 9, "b": 7, "c": 5}, 0.9, 32, batch=b) for b in (None, 1, 2, 3)]
    assert all(p == plans[0] for p in plans)
    plans = [plan_shared(Search(locked), {"a": 3, "b": 3, "c": 2}, 0.9, 32, batch=b) for b in (None, 1, 2)]
    assert all(p == plans[0] for p in plans)


def test_shared_moves_a_replica_where_it_binds_out_of_a_local_minimum() -> None:
    search = Search(locked)
    got = plan_shared(search, {"a": 3, "b": 3, "c": 2}, 0.9, 32, batch=1)
    # removals alone stop at 2 + 3 + 2 = 7; a replica moved into b frees one more
    assert got == {"a": 1, "b": 4, "c": 1}
    assert min(locked([got])[0].values()) >= 0.9


def test_shared_adds_where_the_start_misses() -> None:
    got = plan_shared(Search(shared), {"a": 2, "b": 2, "c": 1}, 0.9, 32)
    assert sum(got.values()) == 9


def test_the_days_shape_ceiling() -> None:
    # two regions peaking at opposite times, each 10 at its peak and 2 at its trough
    opposite = {"a": [10.0] * 4 + [2.0] * 4, "b": [2.0] * 4 + [10.0] * 4}
    assert shape_ceiling(opposite) == pytest.approx(1 - 12 / 20)
    # peaking together: pooling saves nothing by shape
    together = {"a": [10.0] * 4 + [2.0] * 4, "b": [10.0] * 4 + [2.0] * 4}
    assert shape_ceiling(together) == pytest.approx(0.0)


PLAN_DAY = ["plan", "--trace", "hot-prefix", "--requests", "600", "--rate", "12", "--hot-prompts", "12",
            "--diurnal-period-s", "30", "--no-eu-rule", "--rate-multiplier", "40", "--slo", "2",
            "--max-replicas", "8", "--jobs", "1"]


def test_plan_over_the_simulator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command end to end on a small generated day: each layout is measured to meet
    the SLO in every region, region-local's one replica less in a region is measured to
    miss there, and the mesh needs no more than region-local; runs stopped once their
    verdict was decided give the plan that whole runs give."""
    out = tmp_path / "plan"
    rc = skymesh(*PLAN_DAY, "--out", str(out))
    assert rc == 0
    report = json.loads((out / "plan.json").read_text())
    whole = tmp_path / "whole"
    assert skymesh(*PLAN_DAY, "--no-early-stop", "--out", str(whole)) == 0
    whole_report = json.loads((whole / "plan.json").read_text())
    assert report["plans"] == whole_report["plans"]
    assert report["attainment"] == whole_report["attainment"]  # the plans' days are run whole
    assert report["early_stop"]["region-local"]["stopped_early"] > 0
    assert whole_report["early_stop"]["on"] is False and whole_report["early_stop"]["mesh"]["stopped_early"] == 0
    assert (out / "plan.png").stat().st_size > 0
    plans, trials = report["plans"], report["trials"]
    assert set(plans) == {"region-local", "mesh"}
    for label in plans:
        assert min(report["attainment"][label].values()) >= 0.9
    local = plans["region-local"]
    assert sum(local.values()) > len(local)  # a day that needs more than one replica somewhere
    for r, n in local.items():
        if n > 1:
            misses = [t for t in trials["region-local"] if t["layout"][r] == n - 1]
            assert misses and all(t["attainment"][r] < 0.9 for t in misses)
    assert report["replicas"]["mesh"] <= report["replicas"]["region-local"]
    assert report["mesh_saving"] == pytest.approx(1 - report["replicas"]["mesh"] / report["replicas"]["region-local"],
                                                  abs=1e-4)
    # the day's load per region over time, and what each region's replicas served
    day = report["days"]["mesh"]
    assert sum(sum(v) for v in day["load"].values()) == pytest.approx(sum(sum(v) for v in day["served"].values()),
                                                                      rel=0.05)
    assert "fewer" in capsys.readouterr().out


def test_the_shared_searches_side_by_side_make_the_plans_they_make_alone(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """With a pool, the mesh's and the pooled bound's searches run side by side (both
    start from region-local's plan); each makes the plan and reports the attainment it
    does run alone, one after the other."""
    day = [*PLAN_DAY, "--jobs", "2", "--pooled-bound"]  # the last --jobs counts
    side = tmp_path / "side"
    assert skymesh(*day, "--out", str(side)) == 0
    assert "side by side" in capsys.readouterr().out
    alone = tmp_path / "alone"
    assert skymesh(*PLAN_DAY, "--pooled-bound", "--out", str(alone)) == 0
    a, b = (json.loads((d / "plan.json").read_text()) for d in (side, alone))
    assert set(a["plans"]) == {"region-local", "mesh", "pooled bound"}
    # (the layouts tried may differ: --jobs also sets how many removals run ahead)
    assert a["plans"] == b["plans"] and a["attainment"] == b["attainment"]


def test_plan_refuses_a_day_it_cannot_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert "needs --regions 2" in str(skymesh("plan", "--regions", "1", "--trace", "hot-prefix"))
    assert "--target" in str(skymesh("plan", "--trace", "hot-prefix", "--target", "1.5"))
    assert "--seeds" in str(skymesh("plan", "--trace", "hot-prefix", "--seeds", "x"))
    assert "--amplitude" in str(skymesh("plan", "--trace", "hot-prefix", "--amplitude", "0.1,0.2"))


def test_a_result_is_reused_only_where_it_answers_the_question() -> None:
    asked: list[StopWhen | None] = []

    def evaluate(layouts: Sequence[Layout], stop: StopWhen | None = None) -> list[dict[str, float]]:
        asked.extend(stop for _ in layouts)
        return independent(layouts)

    search = Search(evaluate)
    lay = {"a": 6, "b": 3, "c": 1}
    search.run([lay], StopWhen.ANY_REGION_FAILS)
    search.run([lay], StopWhen.ANY_REGION_FAILS)  # the same question: reused
    search.run([lay], StopWhen.EVERY_REGION_DECIDED)  # the mesh's verdict does not give each region's
    search.run([lay], StopWhen.ANY_REGION_FAILS)  # each region's gives the mesh's
    search.run([lay])  # a whole run: evaluated again
    search.run([lay], StopWhen.EVERY_REGION_DECIDED)  # and answers everything after it
    assert asked == [StopWhen.ANY_REGION_FAILS, StopWhen.EVERY_REGION_DECIDED, None]


@pytest.mark.parametrize(("jobs", "side_by_side"), [(1, False), (2, False), (2, True)])
def test_an_interrupted_plan_writes_what_it_found(tmp_path: Path, jobs: int, side_by_side: bool) -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) once the first
    layouts were evaluated (``side_by_side``: once the mesh's and the pooled bound's
    searches run side by side): the plan stops cleanly, exits 130 and leaves a readable
    plan.json with every layout evaluated so far; its pool's workers end silently (no
    traceback of theirs)."""
    import os
    import signal
    import subprocess
    import sys

    def own_group_and_default_sigint() -> None:
        # a process group of its own, as a terminal's foreground job; SIGINT as a
        # terminal's Ctrl-C finds it: a runner that started this test in the background
        # (a non-interactive shell's `&`) hands its children SIGINT ignored, and a Python
        # started so installs no KeyboardInterrupt handler
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    out = tmp_path / "plan"
    argv = [sys.executable, "-m", "skymesh.cli", *PLAN_DAY, "--jobs", str(jobs), "--out", str(out),
            *(["--pooled-bound"] if side_by_side else [])]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).resolve().parent.parent, preexec_fn=own_group_and_default_sigint)
    try:
        assert proc.stdout is not None
        seen = []
        waiting_for = "side by side" if side_by_side else "layouts in"
        for line in proc.stdout:
            seen.append(line)
            if waiting_for in line and waiting_for != "layouts in":
                waiting_for = "layouts in"  # then the first batch of the searches side by side
            elif waiting_for in line:  # the progress line after a batch of layouts
                os.killpg(proc.pid, signal.SIGINT)
                break
        rest = proc.stdout.read()
        assert proc.wait() == 130, "".join(seen) + rest
        assert "Traceback" not in rest, rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    report = json.loads((out / "plan.json").read_text())
    assert report["interrupted"] is True and "interrupted" in rest
    trials = report["trials"]["region-local"]
    assert trials and all(set(t["attainment"]) == set(t["layout"]) for t in trials)
    assert "region-local" in report["best_so_far"]
    if side_by_side:
        assert report["plans"]["region-local"]  # finished before the interrupt
        assert {"mesh", "pooled bound"} <= set(report["trials"])
        assert any(report["trials"][label] for label in ("mesh", "pooled bound"))


def test_a_plan_whose_worker_dies_writes_what_it_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A pool broken under the plan (a worker killed, or Ctrl-C reaching the workers
    before the plan's own process): what was found so far is written, no traceback."""
    from concurrent.futures.process import BrokenProcessPool

    from skymesh.bench import plan_main

    real = plan_main.Evaluator.__call__
    calls = 0

    def breaks_on_the_third(self: object, layouts: list[Layout], stop: StopWhen | None = None) -> object:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise BrokenProcessPool("a worker ended abruptly")
        return real(self, layouts, stop)  # type: ignore[arg-type]

    monkeypatch.setattr(plan_main.Evaluator, "__call__", breaks_on_the_third)
    out = tmp_path / "plan"
    assert skymesh(*PLAN_DAY, "--out", str(out)) == 1
    assert "ended abruptly" in capsys.readouterr().out
    report = json.loads((out / "plan.json").read_text())
    assert report["interrupted"] is True and len(report["trials"]["region-local"]) == 2


@pytest.mark.parametrize("start", [{"a": 6, "b": 3, "c": 1}, {"a": 20, "b": 9, "c": 5}, {"a": 2, "b": 1, "c": 1},
                                   {"a": 7, "b": 2, "c": 3}])
def test_region_local_from_an_estimate_finds_the_same_counts(start: Layout) -> None:
    search = Search(independent)
    assert plan_region_local(search, REGIONS, 0.9, 32, start=start) == {"a": 6, "b": 3, "c": 1}
    if start == {"a": 6, "b": 3, "c": 1}:
        # an exact estimate: its layout meets, one replica fewer misses, and the answer is
        # run whole to report it
        assert [lay for lay, _ in search.trials] == [start, {"a": 5, "b": 2, "c": 1}, start]


def test_the_estimate_follows_each_regions_busiest_window() -> None:
    from skymesh.bench.plan_estimate import estimate_layout
    from skymesh.bench.traces import TraceRequest
    from skymesh.hardware import PROFILES

    prof = PROFILES["h100-qwen2.5-7b"]
    # region a: 40 distinct 4K-token prompts a second for a minute; b: a tenth of that
    trace = sorted([TraceRequest(i / 40, 4096, 200, tuple(range(i * 8, i * 8 + 8)), "a") for i in range(2400)]
                   + [TraceRequest(i / 4, 4096, 200, tuple(range(10**6 + i * 8, 10**6 + i * 8 + 8)), "b")
                      for i in range(240)], key=lambda r: r.arrival_s)
    est = estimate_layout(trace, ["a", "b", "c"], prof, max_replicas=64)
    assert est["c"] == 1  # no load: one replica
    assert est["a"] > est["b"] >= 1
    assert 8 <= est["a"] / est["b"] <= 12  # ten times the work, rounded up
    # a prompt seen before costs no prefill: the same day with one shared prompt needs fewer
    shared = [TraceRequest(r.arrival_s, r.input_len, r.output_len, tuple(range(8)), r.region) for r in trace]
    assert estimate_layout(shared, ["a", "b", "c"], prof, max_replicas=64)["a"] < est["a"]


def plan_args(*extra: str) -> object:
    import argparse

    from skymesh.bench import plan_main

    p = argparse.ArgumentParser()
    plan_main.add_arguments(p)
    return p.parse_args([*PLAN_DAY[1:], *extra])


@pytest.mark.parametrize("layout", [{"us-east-1": 1, "eu-west-1": 2, "ap-northeast-1": 1},
                                    {"us-east-1": 3, "eu-west-1": 1, "ap-northeast-1": 4}])
def test_a_region_local_regions_day_alone_is_its_day_in_the_whole_mesh(layout: Layout) -> None:
    """What lets the region-local search run each region's count on its own: with no
    offload, a region simulated alone (its clients, its replicas) gives the attainment
    it has in a run of the whole mesh, whole and stopped early alike."""
    from skymesh.bench.plan_main import evaluate_one, evaluate_region

    args = plan_args()
    whole = evaluate_one(args, "dualmap@local", layout, 0)
    stopped = evaluate_one(args, "dualmap@local", layout, 0, StopWhen.EVERY_REGION_DECIDED)
    for region, n in layout.items():
        alone = evaluate_region(args, "dualmap@local", region, n, 0)
        assert alone["attainment"][region] == whole["attainment"][region]
        assert alone["requests"] > 0
        alone_stopped = evaluate_region(args, "dualmap@local", region, n, 0, StopWhen.EVERY_REGION_DECIDED)
        # the bound on the side of the region's verdict, as the whole stopped run gives it
        assert (alone_stopped["attainment"][region] >= 0.9) == (whole["attainment"][region] >= 0.9)
        if "stopped_early" not in stopped:
            assert alone_stopped["attainment"][region] == whole["attainment"][region]
    with pytest.raises(AssertionError):
        evaluate_region(args, "dualmap", "us-east-1", 1, 0)  # offload couples the regions


def test_the_region_local_search_runs_each_regions_count_once() -> None:
    """A region whose count the bisection has settled is not simulated again while the
    others' counts move: the one-region runs are at most the distinct (region, count)
    pairs the search tried, each made once, and fewer than a run per region per layout."""
    from skymesh.bench.plan_main import Evaluator

    args = plan_args()
    names = ["us-east-1", "eu-west-1", "ap-northeast-1"]
    evaluator = Evaluator(args, "dualmap@local", [0], None)
    search = Search(evaluator)
    plan = plan_region_local(search, names, 0.9, 8)
    steps = [lay for lay, _ in search.trials[:-1]]  # the bisection's (the last: the plan run whole)
    assert len(steps) >= 2
    assert evaluator.region_runs == len({(r, lay[r]) for lay in steps for r in names})
    assert evaluator.region_runs < len(names) * len(steps)  # settled regions were not run again
    assert search.trials[-1][0] == plan
