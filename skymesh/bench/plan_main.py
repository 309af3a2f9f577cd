"""``skymesh plan``: the fewest replicas per region that meet the SLO over a day, for the
mesh (cross-region offload, under the residency rules) and for region-local serving, found
by simulating the live routing code (the discrete-event simulator over the same region
core the balancers run, skymesh/bench/des.py).

The day is ``skymesh sim``'s: a trace (with regions of its own, or sessions shared among
the regions by ``--region-weights`` / ``--skew``) over ``--regions``, each region's
arrivals swinging by its own diurnal curve (``--diurnal-period-s``, ``--amplitude``,
``--phases``), at ``--rate-multiplier`` times the trace's rate. A layout meets the SLO when
every region's clients get at least ``--target`` of their first tokens within ``--slo``
seconds on every seed of ``--seeds`` (skymesh/bench/plan.py says how each search runs).

Writes ``plan.json`` (the layouts, the saving, every evaluated layout with its attainment
per region) and ``plan.png`` (each region's load and what its replicas served over the
day, on the mesh's layout and on region-local's) to ``--out`` (default bench-out/plan).

    skymesh plan --regions 3 --diurnal-period-s 1200 --duration-s 1200 --rate-multiplier 10

``--config FILE`` plans the operator's own mesh instead: its regions, latencies, policy,
queue, offload rules and replicas' profile (sim_setup.apply_config; docs/planning.md, "Your
own mesh: --config").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np

from skymesh.bench import sim_setup
from skymesh.bench.day_shape import day_shape
from skymesh.bench.des import Simulator
from skymesh.bench.plan import Attainment, Layout, PlanError, Search, plan_region_local, plan_shared
from skymesh.bench.plan_estimate import estimate_layout
from skymesh.bench.sim_result import SimResult
from skymesh.bench.verdict import StopWhen, VerdictWatch
from skymesh.hardware import PROFILES
from skymesh.runtime.procs import quiet_pool_worker

# sim options that mean nothing to a plan (it chooses the replicas and the systems itself)
NOT_FOR_PLAN = {"systems", "replicas", "region_replicas", "rates", "goodput_search", "resolution", "windows",
                "seed"}
# the day's load and served traffic are counted in bins of this many seconds for the plot
BINS = 48


def add_arguments(p: argparse.ArgumentParser) -> None:
    sim_setup.add_arguments(p)
    for action in p._actions:  # argparse has no public way to hide an inherited option
        if action.dest in NOT_FOR_PLAN:
            action.help = argparse.SUPPRESS
    p.set_defaults(regions=3, out="bench-out/plan", seeds="0")
    for action in p._actions:
        if action.dest == "seeds":
            action.help = "arrival seeds (sessions' regions, thinning): a layout must meet the SLO on each"
        elif action.dest == "pooled_bound":
            action.help = ("also plan the pooled bound (every replica one pool, no residency rule): the fewest "
                           "replicas any cross-region offload could need")
    p.add_argument("--rate-multiplier", type=float, default=1.0,
                   help="the load to plan for: this many times the trace's (the day's) arrival rate")
    p.add_argument("--target", type=float, default=0.9,
                   help="SLO attainment every region's clients must reach (share of first tokens within --slo)")
    p.add_argument("--policy", default="dualmap", action=sim_setup.Given,
                   help="the routing policy in every region (--config: the config's policy.name)")
    p.add_argument("--max-replicas", type=int, default=32, help="the most replicas a region may get")


# the day's shape ceiling is read over coarser bins (every 4 of BINS): 12 per day, so a
# region's peak is its curve's, not one bin's burst
SHAPE_BINS_PER = 4


def shape_ceiling(load: dict[str, list[float]]) -> float:
    """What pooling could save at most by the day's shape alone: 1 - the peak of the
    regions' summed arrival rate / the sum of each region's own peak rate (replicas sized
    for peaks, as fluid, with no queueing or cache effect). Coarse bins of the day's load."""
    per = {r: [sum(v[i:i + SHAPE_BINS_PER]) for i in range(0, len(v), SHAPE_BINS_PER)] for r, v in load.items()}
    sum_of_peaks = sum(max(v) for v in per.values())
    peak_of_sum = max(sum(vals) for vals in zip(*per.values(), strict=True))
    return 1.0 - peak_of_sum / sum_of_peaks if sum_of_peaks > 0 else 0.0


def layout_arg(layout: Layout) -> str:
    return ",".join(f"{r}={n}" for r, n in layout.items())


def stopped_run(watch: VerdictWatch, names: list[str], res: SimResult, requests: int) -> dict[str, Any]:
    """A run stopped once its verdict was decided, as a plan reads it: each region's
    attainment is the watch's bound on the side of its verdict (a region decided to
    pass, its lowest; any other, its highest: a failing region's is under the target)."""
    bounds = watch.bounds()
    att = {r: bounds[r][0] if watch.verdict(k) else bounds[r][1] for k, r in enumerate(names)}
    return {"attainment": att, "stopped_early": res.stopped_early, "requests": requests,
            "simulated": int(res.arrival.size)}


def evaluate_one(args: argparse.Namespace, system: str, layout: Layout, seed: int,
                 stop: StopWhen | None = None) -> dict[str, Any]:
    """One simulated day of ``system`` on ``layout`` (picklable: runs in a worker),
    stopped as ``stop`` says once its verdict against ``--target`` is decided (its
    attainment is then the watch's bound on the side of its verdict, and
    ``stopped_early`` says why)."""
    run_args = argparse.Namespace(**{**vars(args), "region_replicas": layout_arg(layout), "seed": seed})
    names = list(sim_setup.mesh_of(args).names)
    trace = list(sim_setup.build_trace(run_args, args.rate_multiplier))
    cfg = sim_setup.sim_config(run_args, system)
    watch = None
    if stop is not None:
        default = next(iter(cfg.regions))
        watch = VerdictWatch.for_requests(names, [r.arrival_s for r in trace],
                                          [r.region if r.region in cfg.regions else default for r in trace],
                                          slo_s=args.slo, target=args.target, when=stop, warmup_s=args.warmup_s)
    res = Simulator(cfg).run(trace, watch=watch)
    if res.stopped_early:
        assert watch is not None
        return stopped_run(watch, names, res, len(trace))
    regions = res.region_summaries(args.slo, args.warmup_s)
    span = float(res.arrival.max()) if res.arrival.size else 1.0
    edges = np.linspace(0.0, max(span, 1e-9), BINS + 1)
    width = float(edges[1] - edges[0])
    load = {r: (np.histogram(res.arrival[res.client_region == k], edges)[0] / width).round(3).tolist()
            for k, r in enumerate(names)}
    served = {r: (np.histogram(res.arrival[res.served_region == k], edges)[0] / width).round(3).tolist()
              for k, r in enumerate(names)}
    return {"attainment": {r: regions[r]["slo_attainment"] for r in names},
            "offloaded": {r: regions[r]["offloaded_share"] for r in names},
            "requests": int(res.arrival.size), "rate": round(res.arrival.size / max(span, 1e-9), 3),
            "overall": res.summary(args.slo, args.warmup_s)["slo_attainment"],
            "bins_s": edges.round(2).tolist(), "load": load, "served": served}


def evaluate_region(args: argparse.Namespace, system: str, region: str, replicas: int, seed: int,
                    stop: StopWhen | None = None) -> dict[str, Any]:
    """One region of a region-local ``system`` (no offload) alone: its clients' requests
    of the day on its ``replicas``, nothing else simulated. With no offload a region's
    day is its own (the same attainment as in a run of the whole mesh,
    tests/test_plan.py), so the region-local search runs each region's count as a job of
    its own (side by side with ``--jobs``) and runs a count it has measured once no
    more. Stopped as ``stop`` says once the region's verdict is decided."""
    assert sim_setup.is_region_local(system), system
    run_args = argparse.Namespace(**{**vars(args), "region_replicas": f"{region}={replicas}", "seed": seed})
    trace = [q for q in sim_setup.build_trace(run_args, args.rate_multiplier) if q.region == region]
    full = sim_setup.sim_config(run_args, system)
    cfg = dataclasses.replace(full, regions={region: replicas},
                              one_way_ms={k: v for k, v in full.one_way_ms.items() if k == (region, region)})
    watch = None
    if stop is not None:
        watch = VerdictWatch.for_requests([region], [q.arrival_s for q in trace], [region] * len(trace),
                                          slo_s=args.slo, target=args.target, when=stop, warmup_s=args.warmup_s)
    res = Simulator(cfg).run(trace, watch=watch)
    if res.stopped_early:
        assert watch is not None
        return stopped_run(watch, [region], res, len(trace))
    return {"attainment": {region: res.region_summaries(args.slo, args.warmup_s)[region]["slo_attainment"]},
            "requests": int(res.arrival.size)}


class Evaluator:
    """Runs layouts of one system over every plan seed side by side; keeps what each
    layout's first seed showed over the day (for the plot)."""

    def __init__(self, args: argparse.Namespace, system: str, seeds: list[int], pool: ProcessPoolExecutor | None):
        self.args, self.system, self.seeds, self.pool = args, system, seeds, pool
        self.days: dict[str, dict[str, Any]] = {}
        # layouts whose runs stopped once their verdict was decided, and for each the
        # share of the day's requests it simulated
        self.stopped_early = 0
        self.simulated_share: list[float] = []
        self.started = time.perf_counter()
        self.tried = 0
        # the layout with the fewest replicas measured to meet the target so far
        self.best: tuple[Layout, Attainment] | None = None
        # every layout evaluated, as it was (an interrupted plan writes these)
        self.evaluated: list[tuple[Layout, Attainment]] = []
        # region-local: (region, replicas, seed, stop) -> that region's run alone
        self._region_runs: dict[tuple[str, int, int, StopWhen | None], dict[str, Any]] = {}

    def __call__(self, layouts: list[Layout], stop: StopWhen | None = None) -> list[Attainment]:
        if self.args.no_early_stop:
            stop = None
        jobs = [(lay, s) for lay in layouts for s in self.seeds]
        if stop is not None and sim_setup.is_region_local(self.system):
            outs = self._by_region(jobs, stop)
        elif self.pool is not None:
            outs = list(self.pool.map(evaluate_one, *zip(*[(self.args, self.system, lay, s, stop) for lay, s in jobs],
                                                         strict=True)))
        else:
            outs = [evaluate_one(self.args, self.system, lay, s, stop) for lay, s in jobs]
        per = len(self.seeds)
        result = []
        for i, lay in enumerate(layouts):
            runs = outs[i * per:(i + 1) * per]
            stopped = [run["stopped_early"] for run in runs if "stopped_early" in run]
            if not stopped:
                if "by_region" not in runs[0]:  # a day of the whole mesh (the plot's)
                    self.days[layout_arg(lay)] = runs[0]
            else:
                self.stopped_early += 1
                self.simulated_share.append(sum(run.get("simulated", run["requests"]) for run in runs)
                                            / max(1, sum(run["requests"] for run in runs)))
            att = {r: min(run["attainment"][r] for run in runs) for r in lay}
            result.append(att)
            self.evaluated.append((dict(lay), att))
            self.tried += 1
            if min(att.values()) >= self.args.target and (self.best is None
                                                          or sum(lay.values()) < sum(self.best[0].values())):
                self.best = (dict(lay), att)
            note = f"  (stopped early: {stopped[0]})" if stopped else ""
            print(f"  {self.system:<18} {layout_arg(lay):<48} attainment "
                  + " ".join(f"{r}={v:.3f}" for r, v in att.items()) + note, flush=True)
        print(f"    {self.progress()}", flush=True)
        return result

    @property
    def region_runs(self) -> int:
        """One-region runs made (each (region, count, seed) once)."""
        return len(self._region_runs)

    def _by_region(self, jobs: list[tuple[Layout, int]], stop: StopWhen) -> list[dict[str, Any]]:
        """Each (layout, seed) of a region-local search from one run per region (each
        (region, count, seed) run once: a region whose count the search has settled
        costs nothing more), combined as one layout's run would read."""
        todo = list(dict.fromkeys((r, n, s) for lay, s in jobs for r, n in lay.items()
                                  if (r, n, s, stop) not in self._region_runs))
        if todo:
            args = [(self.args, self.system, r, n, s, stop) for r, n, s in todo]
            if self.pool is not None:
                done = list(self.pool.map(evaluate_region, *zip(*args, strict=True)))
            else:
                done = [evaluate_region(*a) for a in args]
            for (r, n, s), out in zip(todo, done, strict=True):
                self._region_runs[(r, n, s, stop)] = out
        outs = []
        for lay, s in jobs:
            runs = [self._region_runs[(r, n, s, stop)] for r, n in lay.items()]
            out: dict[str, Any] = {"attainment": {r: run["attainment"][r] for r, run in zip(lay, runs, strict=True)},
                                   "by_region": True, "requests": sum(run["requests"] for run in runs),
                                   "simulated": sum(run.get("simulated", run["requests"]) for run in runs)}
            why = next((run["stopped_early"] for run in runs if "stopped_early" in run), None)
            if why is not None:
                out["stopped_early"] = why
            outs.append(out)
        return outs

    def progress(self) -> str:
        """Layouts tried, the best so far and its worst region, time spent."""
        best = "none meets the target yet"
        if self.best is not None:
            lay, att = self.best
            best = (f"best so far {layout_arg(lay)} ({sum(lay.values())} replicas, worst region "
                    f"{min(att.values()):.3f})")
        return (f"[{self.system}: {self.tried} layouts in {time.perf_counter() - self.started:.0f} s; "
                f"{self.stopped_early} stopped early; {best}]")


def plot(path: Path, names: list[str], plans: dict[str, Layout], days: dict[str, dict[str, Any]], slo: float,
         rate_multiplier: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.4 * len(names)), sharex=True, squeeze=False)
    for ax, region in zip(axes[:, 0], names, strict=True):
        mesh, local = days.get("mesh"), days.get("region-local")
        ref = mesh or local
        if ref is None:
            continue
        t = np.asarray(ref["bins_s"])
        mid = (t[:-1] + t[1:]) / 2 * rate_multiplier  # the day's own clock (the run compresses it)
        ax.plot(mid, ref["load"][region], color="black", label="its clients' requests (load)")
        if mesh is not None:
            ax.plot(mid, mesh["served"][region], color="tab:blue",
                    label=f"served by its replicas, mesh ({plans['mesh'][region]} replicas)")
        if local is not None:
            ax.plot(mid, local["served"][region], color="tab:orange", linestyle="--",
                    label=f"served, region-local ({plans['region-local'][region]} replicas)")
        ax.set_title(region, fontsize=9)
        ax.set_ylabel("req/s (simulated)")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel(f"time of day (trace s; simulated {rate_multiplier:g}x faster)")
    fig.suptitle(f"skymesh plan: load and served traffic per region (x{rate_multiplier:g}, TTFT SLO {slo:g} s)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_partial(out: Path, args: argparse.Namespace, plans: dict[str, Layout],
                  searches: dict[str, Evaluator], wall_s: float) -> Path:
    """``plan.json`` of an interrupted plan: the plans finished, and for each search begun
    every layout evaluated and the best (fewest replicas) measured to meet the target."""
    report = {
        "interrupted": True,
        "slo": {"ttft_s": args.slo, "target": args.target},
        "plans": plans,
        "best_so_far": {label: None if ev.best is None else {"layout": ev.best[0], "attainment": ev.best[1]}
                        for label, ev in searches.items()},
        "trials": {label: [{"layout": lay, "attainment": att} for lay, att in ev.evaluated]
                   for label, ev in searches.items()},
        "wall_s": round(wall_s, 1),
    }
    path = out / "plan.json"
    path.write_text(json.dumps(report, indent=1))
    return path


def interrupt_landed(grace_s: float = 0.2) -> bool:
    """After the pool broke: whether a Ctrl-C is what broke it. The terminal's SIGINT
    reaches this process and its workers at once, and a worker may die of it before this
    process runs its own handler (most often on a busy machine); waiting a moment lets a
    pending interrupt land here, not in the middle of writing the partial plan."""
    try:
        time.sleep(grace_s)
    except KeyboardInterrupt:
        return True
    return False


def run(args: argparse.Namespace) -> int:
    mesh = sim_setup.mesh_of(args)  # with --config: the file loaded and checked first
    if args.regions < 2:
        raise SystemExit("skymesh plan: needs --regions 2 or more (one region has nothing to pool)"
                         if mesh.config is None else f"skymesh plan: {mesh.config} has one region: nothing to pool")
    if not mesh.routing.offload.enabled:
        raise SystemExit(f"skymesh plan: {mesh.config} has offload.enabled: false, so its mesh would be "
                         "region-local: enable offload in a copy to plan what it saves")
    if not 0.0 < args.target <= 1.0:
        raise SystemExit("--target: a share in (0, 1]")
    if args.max_replicas < 1 or args.rate_multiplier <= 0:
        raise SystemExit("--max-replicas and --rate-multiplier: positive")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds: comma-separated integers, got {args.seeds!r}") from None
    if not seeds:
        raise SystemExit("--seeds: at least one seed")
    sim_setup.check_policy_options([args.policy], sim_setup.parse_policy_options(args.policy_option))
    names = list(mesh.names)
    sim_setup.build_trace(args)  # the day's options checked before any simulation starts
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    systems = {"region-local": f"{args.policy}@{sim_setup.LOCAL}", "mesh": args.policy}
    if args.pooled_bound:
        systems["pooled bound"] = f"{args.policy}@pooled"
    t0 = time.perf_counter()
    # region-local's search starts from each region's offered work (the first seed's day)
    day = list(sim_setup.build_trace(argparse.Namespace(**{**vars(args), "seed": seeds[0]}), args.rate_multiplier))
    start = estimate_layout(day, names, PROFILES[args.profile], max_replicas=args.max_replicas)
    print(f"estimated from the day's offered work: {layout_arg(start)}", flush=True)
    plans: dict[str, Layout] = {}
    trials: dict[str, list[dict[str, Any]]] = {}
    days: dict[str, dict[str, Any]] = {}
    early: dict[str, dict[str, Any]] = {}
    pool = ProcessPoolExecutor(max_workers=args.jobs, initializer=quiet_pool_worker) if args.jobs > 1 else None
    searches: dict[str, Evaluator] = {}
    started: dict[str, Search] = {}

    def begin(label: str) -> Search:
        evaluator = Evaluator(args, systems[label], seeds, pool)
        searches[label] = evaluator
        started[label] = Search(evaluator)
        return started[label]

    def descend(label: str) -> Layout:
        return plan_shared(started[label], plans["region-local"], args.target, args.max_replicas, batch=args.jobs)

    try:
        print(f"region-local ({systems['region-local']}):", flush=True)
        plans["region-local"] = plan_region_local(begin("region-local"), names, args.target, args.max_replicas,
                                                  start=start)
        shared = [label for label in systems if label != "region-local"]
        for label in shared:
            begin(label)
        if pool is not None and len(shared) > 1:
            # the shared searches (the mesh, the pooled bound) both start from
            # region-local's plan and are independent: side by side over the one pool,
            # each fills the workers the other's one-layout steps leave idle; each makes
            # the plan it makes alone (its lines are prefixed with its system)
            print(" and ".join(f"{label} ({systems[label]})" for label in shared) + ", side by side:", flush=True)
            threads = ThreadPoolExecutor(max_workers=len(shared), thread_name_prefix="plan-search")
            try:
                descents = {label: threads.submit(descend, label) for label in shared}
                for label in shared:
                    plans[label] = descents[label].result()
            finally:
                threads.shutdown(wait=False, cancel_futures=True)
        else:
            for label in shared:
                print(f"{label} ({systems[label]}):", flush=True)
                plans[label] = descend(label)
        for label in systems:
            search, evaluator = started[label], searches[label]
            trials[label] = [{"layout": lay, "attainment": att} for lay, att in search.trials]
            days[label] = evaluator.days[layout_arg(plans[label])]
            shares = evaluator.simulated_share
            early[label] = {"layouts": len(search.trials), "stopped_early": evaluator.stopped_early,
                            "mean_share_simulated": round(sum(shares) / len(shares), 4) if shares else None,
                            "one_region_runs": evaluator.region_runs}
    except PlanError as e:
        if pool is not None:  # a search still running side by side stops at its next batch
            pool.shutdown(wait=False, cancel_futures=True)
            pool = None
        raise SystemExit(f"skymesh plan: {e}") from None
    except (KeyboardInterrupt, BrokenProcessPool) as e:
        # Ctrl-C reaches the workers too: the pool may break before the main process
        # sees the interrupt (a worker killed otherwise breaks it the same way)
        interrupted = isinstance(e, KeyboardInterrupt) or interrupt_landed()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
            pool = None
        path = write_partial(out, args, plans, searches, time.perf_counter() - t0)
        why = "interrupted" if interrupted else "a simulation worker ended abruptly"
        print(f"\n{why}: what was found so far is in {path}", flush=True)
        return 130 if interrupted else 1
    finally:
        if pool is not None:
            pool.shutdown()
    total = {label: sum(lay.values()) for label, lay in plans.items()}
    saving = 1.0 - total["mesh"] / total["region-local"]
    report = {
        "day": {"trace": args.trace, "regions": names, "rate_multiplier": args.rate_multiplier,
                "rate": days["mesh"]["rate"], "requests": days["mesh"]["requests"],
                **day_shape(args, len(names)).describe(), "start_s": args.start_s,
                "duration_s": args.duration_s},
        "slo": {"ttft_s": args.slo, "target": args.target, "seeds": seeds, "residency": mesh.residency()},
        "estimate": start, "config": mesh.config, "profile": args.profile, "policy": args.policy, "plans": plans, "replicas": total,
        "mesh_saving": round(saving, 4),
        "shape_ceiling": round(shape_ceiling(days["mesh"]["load"]), 4),
        # the last run of each plan's layout: a whole one (skymesh/bench/plan.py)
        "attainment": {label: [t["attainment"] for t in trials[label] if t["layout"] == plans[label]][-1]
                       for label in plans},
        "early_stop": {"on": not args.no_early_stop, **early},
        "offloaded": {label: days[label]["offloaded"] for label in plans},
        "trials": trials, "days": days, "wall_s": round(time.perf_counter() - t0, 1),
    }
    (out / "plan.json").write_text(json.dumps(report, indent=1))
    plot(out / "plan.png", names, plans, days, args.slo, args.rate_multiplier)
    rule = "no residency rule" if not mesh.routing.offload.rules else f"residency: {mesh.residency()}"
    print(f"\nday: {days['mesh']['requests']} requests at {days['mesh']['rate']:g} req/s "
          f"(x{args.rate_multiplier:g}); TTFT SLO {args.slo:g} s met by >= {args.target:g} of every region's "
          f"requests on seeds {', '.join(map(str, seeds))}; {rule}\n")
    print("| layout | " + " | ".join(names) + " | total | worst region's attainment |")
    print("|---|" + "---|" * (len(names) + 2))
    for label, lay in plans.items():
        att = report["attainment"][label]
        print(f"| {label} | " + " | ".join(str(lay[r]) for r in names)
              + f" | {total[label]} | {min(att.values()):.3f} |")
    print(f"\nthe mesh needs {total['mesh']} replicas, region-local {total['region-local']}: "
          f"{saving:.0%} fewer (the day's shape alone allows about {report['shape_ceiling']:.0%}: "
          "the peak of the regions' summed load against the sum of their own peaks)")
    print(f"wrote {out / 'plan.json'} and {out / 'plan.png'} ({report['wall_s']} s)")
    return 0
