"""What a discrete-event run is made of, shared by ``skymesh sim`` (``sim_main.py``), its
goodput search (``search_main.py``), ``skymesh plan`` (``plan_main.py``), the live-geo
layout (``live_geo.py``) and the scripts under benchmarks/: the command line's options
(:func:`add_arguments`), the simulated mesh (:func:`mesh_of`, ``--config`` through
:func:`apply_config`), the workload (:func:`build_trace`), the systems and their variants
(:func:`systems_of`, :func:`split_system`, the pooled bound), one system's simulator
settings (:func:`sim_config`) and one simulation (:func:`run_one`).

It imports neither command module, so both import it (``sim_main`` also imports
``search_main``, for ``--goodput-search``) and no import runs in a circle.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from skymesh.assembly import RoutingConfig
from skymesh.bench.classes import add_class_arguments, slo_classes, with_slo_mix
from skymesh.bench.day_shape import add_day_arguments, day_shape
from skymesh.bench.des import Simulator
from skymesh.bench.sim_config import SimConfig, simulated_policy
from skymesh.bench.trace_args import trace_argument
from skymesh.bench.traces import (
    DEFAULT_TRACE,
    TraceRequest,
    load_mooncake,
    scale_rate,
    window,
)
from skymesh.bench.verdict import StopWhen, VerdictWatch
from skymesh.bench.workloads import (
    ConversationMix,
    hot_prefix_workload,
    synthetic_conversations,
    tree_of_thoughts,
)
from skymesh.config import MeshConfig, load_config_for_command
from skymesh.config.routing import OffloadConfig, OffloadRule, QueueConfig
from skymesh.routing.offload import OffloadTrigger
from skymesh.routing.pair_registry import PAIR_RULES
from skymesh.routing.registry import (
    PolicyOptionsError,
    UnknownPolicyError,
    policy_options,
    policy_spec,
)
from skymesh.word_tokenizer import TRACE_BLOCK_TOKENS

GEO3 = ["us-east-1", "eu-west-1", "ap-northeast-1"]
GEO3_LATENCY = {("us-east-1", "eu-west-1"): 40.0, ("us-east-1", "ap-northeast-1"): 80.0,
                ("eu-west-1", "ap-northeast-1"): 110.0}
SYNTHETIC = ("hot-prefix", "tot2", "tot4", "synthetic")


# the local default's GDPR-style rule (skymesh/local.yaml): eu-* regions offload only to eu-*
EU_STAYS_IN_EU = OffloadRule.model_validate({"from": "eu-*", "to": ["eu-*"]})


def region_layout(n: int) -> tuple[list[str], dict[tuple[str, str], float]]:
    """Region names and one-way latencies (ms): the local default's three AWS regions, or
    ``r0..r{n-1}`` on a line, 10 ms + 10 ms per hop apart."""
    if n == 1:
        return ["central"], {}
    if n == 3:
        return list(GEO3), dict(GEO3_LATENCY)
    names = [f"r{i}" for i in range(n)]
    lat = {(a, b): 10.0 + 10.0 * abs(i - j) for i, a in enumerate(names) for j, b in enumerate(names) if i < j}
    return names, lat


class Given(argparse.Action):
    """``store``, also noting that the option was given (``args.given``): with ``--config``
    the config supplies an option's default and only an option given on the command line
    overrides it (:func:`apply_config`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether option ``dest`` was given on the command line (an option with ``action=Given``)."""
    return dest in getattr(args, "given", ())


@dataclass(frozen=True)
class Mesh:
    """The regions a run simulates: their names in order (the order of the day's options),
    one-way latencies (ms) per pair, replicas per region, and the routing sections every
    region core starts from (the mesh config's, or the command line's defaults)."""

    names: tuple[str, ...]
    one_way_ms: dict[tuple[str, str], float]
    routing: RoutingConfig
    replicas: dict[str, int] | None = None  # the config's counts; None: --replicas
    config: str | None = None  # the file, with --config

    def residency(self) -> str:
        """The residency rules in words (plan.json, the plan's summary)."""
        rules = self.routing.offload.rules
        return "; ".join(f"{r.source} stays in {' or '.join(r.allowed_targets)}" for r in rules) or "none"


def mesh_of(args: argparse.Namespace) -> Mesh:
    """The mesh ``args`` simulate: the ``--config`` file's (loaded once, :func:`apply_config`),
    or ``--regions``' layout with the EU rule unless ``--no-eu-rule``."""
    if getattr(args, "config", None):
        return apply_config(args)
    names, lat = region_layout(args.regions)
    rules = () if args.no_eu_rule else (EU_STAYS_IN_EU,)
    return Mesh(tuple(names), lat, RoutingConfig(offload=OffloadConfig(rules=rules)))


# with --config: options the config's sections supply unless given on the command line
CONFIG_DEFAULTS: dict[str, Callable[[MeshConfig], Any]] = {
    "slo": lambda cfg: cfg.policy.ttft_slo_s,
    "probe_interval_s": lambda cfg: cfg.policy.probe_interval_s,
    "offload_trigger": lambda cfg: cfg.offload.trigger,
    "queue_discipline": lambda cfg: cfg.queue.discipline,
    "queue_max_age_s": lambda cfg: cfg.queue.max_age_s,
    "prefix_ttft_share": lambda cfg: cfg.queue.prefix_ttft_share,
    "systems": lambda cfg: cfg.policy.name,  # sim: the mesh's policy as written
    "policy": lambda cfg: cfg.policy.name,  # plan
}
# options that describe the regions themselves: the config does, so they are refused with it
CONFIG_REFUSES = {"regions": "--regions", "no_eu_rule": "--no-eu-rule"}


def apply_config(args: argparse.Namespace) -> Mesh:
    """``--config FILE``: load and validate the mesh config (its errors all at once, as
    ``skymesh config`` reports them, exit 2) and make it the run's mesh (``args.mesh``).

    - regions, latencies, the replicas per region and ``offload`` (rules, trigger,
      min_gain_s, ...) are the config's; ``--regions`` and ``--no-eu-rule`` are refused with
      it (they would describe another mesh: drop the rule from the file instead);
    - the config supplies the defaults of ``--slo``, ``--probe-interval-s``,
      ``--offload-trigger``, ``--queue-*``, ``--prefix-ttft-share``, ``--systems`` (sim)
      and ``--policy`` (plan), and ``--profile`` (the replicas' ``sim.profile`` when they
      all name the same one); each of these given on the command line overrides it, as do
      ``--replicas`` / ``--region-replicas`` the config's counts.

    Idempotent: the resolved mesh travels in ``args`` to the worker processes."""
    mesh = getattr(args, "mesh", None)
    if mesh is not None:
        return mesh
    refused = [flag for dest, flag in CONFIG_REFUSES.items() if given(args, dest) or getattr(args, dest) is True]
    if refused:
        raise SystemExit(f"--config: {' and '.join(refused)} cannot be combined with it: the config names the "
                         "regions, their latencies and their offload rules (edit or copy the file instead)")
    cfg = load_config_for_command(args.config)
    if cfg is None:
        raise SystemExit(2)
    for dest, default in CONFIG_DEFAULTS.items():
        if hasattr(args, dest) and not given(args, dest):
            setattr(args, dest, default(cfg))
    profiles = tuple(sorted({rep.sim.profile if rep.sim is not None else "" for r in cfg.regions
                             for rep in r.replicas}))
    if not given(args, "profile"):
        if len(profiles) != 1 or not profiles[0]:
            found = ", ".join(p or "replicas without sim:" for p in profiles) or "no replicas in the file"
            raise SystemExit(f"--config {args.config}: the replicas name no single sim.profile ({found}): "
                             "give --profile (the hardware profile every simulated replica runs)")
        args.profile = profiles[0]
    names = tuple(r.name for r in cfg.regions)
    args.regions = len(names)
    args.mesh = Mesh(names, dict(cfg.latency_ms), RoutingConfig.of(cfg),
                     replicas={r.name: len(r.replicas) for r in cfg.regions}, config=str(args.config))
    return args.mesh


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE",
                   help="simulate this mesh config (skymesh config --config FILE validates it): its regions, "
                        "latencies, replicas, sim.profile and policy/queue/offload sections (residency "
                        "rules); --slo, --profile, --offload-trigger, --systems, ... given here override "
                        "the file's; not with --regions or --no-eu-rule")
    p.add_argument("--trace", default=DEFAULT_TRACE, type=trace_argument(p.prog, SYNTHETIC),
                   help="Mooncake JSONL trace (default: the Mooncake conversation trace in ../shared/traces/, "
                        "not part of the repository), or a generated workload: " + ", ".join(SYNTHETIC))
    p.add_argument("--systems", action=Given, default="dualmap,prefix_tree,cache_aware,min_ttft,preble,least_load,"
                                        "consistent_hash,round_robin")
    p.add_argument("--out", default="bench-out/sim")
    p.add_argument("--replicas", type=int, default=16, action=Given,
                   help="replicas per region (--config: the config's counts unless given)")
    p.add_argument("--region-replicas", default=None, metavar="NAME=N,...",
                   help="replicas of named regions (the others keep --replicas), e.g. eu-west-1=4")
    p.add_argument("--regions", type=int, default=1, action=Given, help="1: one central balancer; 3: us/eu/ap; n: r0..r(n-1)")
    add_day_arguments(p)
    p.add_argument("--no-eu-rule", action="store_true", help="let eu-* regions offload anywhere")
    p.add_argument("--offload-trigger", choices=("predicted_ttft", "saturated"), default="predicted_ttft",
                   action=Given,
                   help="when a region forwards a queued request (routing/offload.py)")
    p.add_argument("--pooled-bound", action="store_true",
                   help="several regions: add POLICY@pooled for every policy of --systems (all replicas "
                        "as one pool behind one region core, clients paying the link RTT to the replica's "
                        "region, no residency rule) and report each system as a fraction of it")
    p.add_argument("--profile", default="h100-qwen2.5-7b", action=Given,
                   help="the replicas' hardware profile (--config: their sim.profile)")
    p.add_argument("--slo", type=float, default=2.0, action=Given, help="TTFT SLO in seconds")
    p.add_argument("--tbt-slo", type=float, default=None,
                   help="TBT target in seconds (the mean of a request's longest 10%% token intervals, Mooncake's): "
                        "a request meets the SLO only within both; records TBT, prices decode legs")
    p.add_argument("--pd-split", default=None, metavar="P:D | REGION=P:D,...",
                   help="prefill/decode pools: P prefill-only and D decode-only replicas per region (the rest "
                        "serve whole requests); needs --pair-rule")
    p.add_argument("--pair-rule", default="never", choices=tuple(PAIR_RULES),
                   help="how requests are split (skymesh/routing/pair_registry.py): never, always, threshold "
                        "(the peers'), conductor (Mooncake's Algorithm 1)")
    p.add_argument("--pair-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the pair rule (e.g. threshold_tokens=256, whole_on_decode=true)")
    p.add_argument("--rates", default="1", help="comma-separated rate multipliers (the goodput sweep)")
    p.add_argument("--start-s", type=float, default=0.0, help="trace window start")
    p.add_argument("--duration-s", type=float, default=0.0, help="trace window length (0: whole trace)")
    p.add_argument("--first-n", type=int, default=None, help="first N requests of the trace")
    p.add_argument("--warmup-s", type=float, default=0.0, help="exclude requests arriving in the first S seconds")
    p.add_argument("--no-early-stop", action="store_true",
                   help="searches (goodput bisections, skymesh plan) run every day to its end, even once its "
                        "verdict against the target is decided (the answer is the same; for comparison)")
    p.add_argument("--requests", type=int, default=4000, help="synthetic workloads: number of requests")
    p.add_argument("--rate", type=float, default=20.0, help="synthetic workloads: base arrival rate (req/s)")
    p.add_argument("--turns-mean", type=float, default=3.0,
                   help="synthetic: turns per conversation on average (each turn's prompt = the last one + "
                        "its answer + a new message)")
    p.add_argument("--max-turns", type=int, default=None, help="synthetic: no conversation has more turns")
    p.add_argument("--region-system-prompts", type=int, default=0,
                   help="synthetic: system prompts of each region's own (0: 8 one-block prompts every region uses)")
    p.add_argument("--system-prompt-blocks", default="1", metavar="LO[-HI]",
                   help="synthetic, with --region-system-prompts: each prompt's length in 512-token blocks "
                        "(drawn once per prompt)")
    p.add_argument("--shared-prefix-share", type=float, default=0.0,
                   help="synthetic, with --region-system-prompts: share of conversations opening with a "
                        "prompt every region shares")
    p.add_argument("--hot-prompts", type=int, default=4, help="hot-prefix: number of popular system prompts")
    p.add_argument("--hot-prompt-blocks", type=int, default=4, help="hot-prefix: system prompt length (512-token blocks)")
    p.add_argument("--hot-share", type=float, default=0.8, help="hot-prefix: share of requests on the popular prompts")
    p.add_argument("--block-size", type=int, default=64,
                   help="simulated KV block (tokens; the profile's KV capacity is kept); 16 = vLLM's")
    p.add_argument("--cache-view", choices=("history", "events"), default="history",
                   help="what cache-aware policies read of a replica's cache: the routing-history trie, "
                        "or the replicas' KV events (routing chunks = engine blocks, token ids per request)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="routing chunk (tokens); default: 512 (one trace block), the block size with "
                        "--cache-view events (which needs them equal)")
    p.add_argument("--probe-interval-s", type=float, default=0.1, action=Given)
    p.add_argument("--balancers-per-region", type=int, default=1,
                   help="active-active balancers per region, sharing push budgets and placements "
                        "(docs/routing.md, 'A region is a fleet')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                   help="policy option for every system (repeatable), e.g. max_hold_fraction=0.2")
    add_class_arguments(p, store=Given)
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel simulations")
    p.add_argument("--goodput-search", action="store_true",
                   help="instead of the --rates sweep: each system's monotone goodput by bisection "
                        "(skymesh/bench/ranking.py) on every variant (--seeds x --windows), with the "
                        "spread, the realistic bound and the rankings every variant agrees on")
    p.add_argument("--resolution", type=float, default=0.05, help="goodput search: relative bracket width")
    p.add_argument("--seeds", default=None, help="goodput search: comma-separated seeds (default: --seed)")
    p.add_argument("--windows", default=None,
                   help="goodput search: trace windows START:DURATION (s), comma-separated "
                        "(default: --start-s/--duration-s)")


def build_trace(args: argparse.Namespace, rate: float = 1.0) -> Iterable[TraceRequest]:
    """The workload at rate multiplier ``rate`` (a list, or a lazy stream for synthetic)."""
    names = list(mesh_of(args).names)
    shape = day_shape(args, len(names))
    if args.trace == "synthetic":
        if args.slo_mix:
            raise SystemExit("--slo-mix: the synthetic stream carries no classes (use a trace or a workload)")
        return synthetic_conversations(args.requests, names, args.rate * rate, seed=args.seed, shape=shape,
                                       mix=conversation_mix(args))
    if args.trace == "hot-prefix":
        reqs = hot_prefix_workload(args.requests, args.rate, n_prompts=args.hot_prompts,
                                   prompt_blocks=args.hot_prompt_blocks, hot_share=args.hot_share, seed=args.seed)
    elif args.trace in ("tot2", "tot4"):
        b = int(args.trace[-1])
        depth = 4 if b == 2 else 3
        per_tree = sum(b ** (d + 1) for d in range(depth))
        reqs = tree_of_thoughts(max(1, args.requests // per_tree), b, depth, args.rate / per_tree, seed=args.seed)
    else:
        reqs = load_mooncake(args.trace, args.first_n)
        if args.duration_s > 0:
            reqs = window(reqs, args.start_s, args.duration_s)
    if len(names) > 1:
        reqs = shape.apply(reqs, names, args.seed)
    reqs = with_slo_mix(reqs, args)
    return scale_rate(reqs, rate) if rate != 1.0 else reqs


def conversation_mix(args: argparse.Namespace) -> ConversationMix:
    """The synthetic stream's conversations as the options describe them (a SystemExit
    naming what does not fit)."""
    lo, _, hi = str(args.system_prompt_blocks).partition("-")
    try:
        blocks = (int(lo), int(hi or lo))
    except ValueError:
        raise SystemExit(f"--system-prompt-blocks: LO or LO-HI blocks, got {args.system_prompt_blocks!r}") from None
    try:
        return ConversationMix(turns_mean=args.turns_mean, max_turns=args.max_turns,
                               region_system_prompts=args.region_system_prompts, system_prompt_blocks=blocks,
                               shared_prefix_share=args.shared_prefix_share)
    except ValueError as e:
        raise SystemExit(f"synthetic workload options: {e}") from None


POOLED = "pooled"
LOCAL = "local"


def split_system(system: str, default_trigger: OffloadTrigger) -> tuple[str, bool, OffloadTrigger]:
    """``NAME`` (offload with ``default_trigger``), ``NAME@local`` (no offload),
    ``NAME@saturated`` (offload by SkyWalker's rule) or ``NAME@pooled`` (the pooled bound:
    one region core, so no offload) -> (policy, offload, trigger)."""
    policy, _, variant = system.partition("@")
    if variant not in ("", LOCAL, "saturated", POOLED):
        raise SystemExit(f"system {system!r}: the suffix is @local, @saturated or @{POOLED}")
    return policy, variant == "" or variant == "saturated", "saturated" if variant == "saturated" else default_trigger


def is_pooled(system: str) -> bool:
    """Whether ``system`` is a pooled bound (``NAME@pooled``)."""
    return system.partition("@")[2] == POOLED


def is_region_local(system: str) -> bool:
    """Whether ``system`` is region-local (``NAME@local``: no region offloads, so each
    region's day is its own)."""
    return system.partition("@")[2] == LOCAL


def pooled_of(system: str) -> str:
    """The pooled bound of ``system``'s policy."""
    return f"{system.partition('@')[0]}@{POOLED}"


def systems_of(args: argparse.Namespace) -> list[str]:
    """``--systems``, and with ``--pooled-bound`` each policy's pooled bound after them."""
    systems = [s for s in args.systems.split(",") if s]
    if getattr(args, "pooled_bound", False):
        if args.regions < 2:
            raise SystemExit("--pooled-bound: needs --regions 2 or more (one region is already one pool)")
        for s in list(systems):
            if pooled_of(s) not in systems:
                systems.append(pooled_of(s))
    return systems


def of_pooled(goodputs: Mapping[str, list[float]]) -> dict[str, list[float | None]]:
    """Each system's goodput per variant as a fraction of its policy's pooled bound's
    (systems whose policy has no pooled row, and the bounds themselves, left out)."""
    out: dict[str, list[float | None]] = {}
    for s, g in goodputs.items():
        bound = goodputs.get(pooled_of(s))
        if is_pooled(s) or bound is None:
            continue
        out[s] = [x / b if b > 0 else None for x, b in zip(g, bound, strict=True)]
    return out


def sim_config(args: argparse.Namespace, system: str) -> SimConfig:
    """What one run of ``system`` simulates: the mesh's routing sections (the config's as
    the daemon reads them, ``RoutingConfig.of``, or the command line's defaults) with the
    system's policy and offload variant and the options the command line sets."""
    policy, offload, trigger = split_system(system, args.offload_trigger)
    pooled = is_pooled(system)
    mesh = mesh_of(args)
    base = mesh.routing
    options = {**base.policy.options.model_dump(exclude_unset=True), **parse_policy_options(args.policy_option)}
    routing = replace(
        base,
        policy=simulated_policy(policy, ttft_slo_s=args.slo, probe_interval_s=args.probe_interval_s,
                                chunk_tokens=chunk_tokens(args), options=options_for(policy, options),
                                **base.policy.model_dump(include={"trie_max_nodes", "max_retries", "max_body_bytes"})),
        queue=QueueConfig.model_validate({**base.queue.model_dump(), "discipline": args.queue_discipline,
                                          "max_age_s": args.queue_max_age_s,
                                          "prefix_ttft_share": args.prefix_ttft_share}),
        # the pooled bound holds no residency rule: under one, the pool by the same policy is
        # no bound (skymesh/bench/des.py, "The pooled bound")
        offload=base.offload.model_copy(update={"enabled": offload and base.offload.enabled, "trigger": trigger,
                                                "rules": () if pooled else base.offload.rules}),
        early_rejection=base.early_rejection and not args.no_early_rejection,
    )
    names = list(mesh.names)
    tbt = getattr(args, "tbt_slo", None)
    return SimConfig(regions=replicas_per_region(args, names), one_way_ms=mesh.one_way_ms,
                     profile=args.profile, routing=routing, block_size=args.block_size, cache_view=args.cache_view,
                     slo_classes=slo_classes(args), balancers_per_region=args.balancers_per_region,
                     pooled=pooled, pd_split=pd_split(getattr(args, "pd_split", None), names),
                     pair_rule=getattr(args, "pair_rule", "never"),
                     pair_options=pair_options(getattr(args, "pair_option", [])),
                     record_tbt=tbt is not None, **({"tbt_slo_s": tbt} if tbt is not None else {}))


def pd_split(spec: str | None, names: Sequence[str]) -> dict[str, tuple[int, int]]:
    """``--pd-split``: ``P:D`` for every region, or ``REGION=P:D,...``."""
    if not spec:
        return {}

    def counts(item: str) -> tuple[int, int]:
        p, sep, d = item.partition(":")
        if not sep or not p.isdigit() or not d.isdigit():
            raise SystemExit(f"--pd-split {item!r}: expected P:D (prefill-only and decode-only replica counts)")
        return int(p), int(d)

    if "=" not in spec:
        return dict.fromkeys(names, counts(spec))
    out = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if name not in names:
            raise SystemExit(f"--pd-split {item!r}: no region {name!r} (regions: {', '.join(names)})")
        out[name] = counts(value)
    return out


def pair_options(items: Sequence[str]) -> dict[str, Any]:
    """``--pair-option KEY=VALUE`` as the rule's options (integers, floats, true/false)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--pair-option {item!r}: expected KEY=VALUE")
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(raw)
                    break
                except ValueError:
                    continue
        out[key] = value
    return out


def replicas_per_region(args: argparse.Namespace, names: Sequence[str]) -> dict[str, int]:
    """``--replicas`` in every region (with ``--config``: the config's counts unless
    ``--replicas`` is given), then ``--region-replicas``."""
    mesh = getattr(args, "mesh", None)
    if mesh is not None and mesh.replicas is not None and not given(args, "replicas"):
        out = {n: mesh.replicas[n] for n in names}
    else:
        out = dict.fromkeys(names, args.replicas)
    for item in filter(None, (args.region_replicas or "").split(",")):
        name, sep, count = item.partition("=")
        if not sep or name not in out or not count.isdigit() or int(count) < 1:
            raise SystemExit(f"--region-replicas {item!r}: expected REGION=N with REGION one of {', '.join(names)}")
        out[name] = int(count)
    empty = [n for n, k in out.items() if k < 1]
    if empty:
        raise SystemExit(f"{', '.join(empty)}: no replicas (a config region whose replicas membership adds "
                         "has none in the file): give --replicas N or --region-replicas REGION=N")
    return out


def chunk_tokens(args: argparse.Namespace) -> int:
    if args.chunk_tokens is not None:
        if args.cache_view == "events" and args.chunk_tokens != args.block_size:
            raise SystemExit("--cache-view events: --chunk-tokens must equal --block-size")
        return int(args.chunk_tokens)
    return int(args.block_size) if args.cache_view == "events" else TRACE_BLOCK_TOKENS


def parse_policy_options(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings to policy options; values parsed as YAML scalars (numbers,
    booleans) so they arrive typed as they would from a config file."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--policy-option {item!r}: expected KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value)
    return out


def options_for(policy: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--policy-option`` values that ``policy`` has, validated and typed by its
    options model: the options apply to every system of a run, each takes its own."""
    model = policy_spec(policy).options
    own = {k: v for k, v in options.items() if k in model.model_fields}
    try:
        return policy_options(policy, own).model_dump(exclude_unset=True)
    except PolicyOptionsError as e:
        raise SystemExit(f"--policy-option {e.path}: {e.message} (policy {policy})") from None


def check_policy_options(systems: list[str], options: Mapping[str, Any]) -> None:
    """Fail before any simulation runs: an option that no system of the run has is a
    typo, and a value is checked by every system that has the option."""
    policies = sorted({s.partition("@")[0] for s in systems})
    try:
        known = set().union(*(policy_spec(p).options.model_fields for p in policies))
    except UnknownPolicyError as e:
        raise SystemExit(f"--systems: {e}") from None
    for key in options:
        if key not in known:
            raise SystemExit(f"--policy-option {key}: unknown option for {', '.join(policies)} "
                             f"(known: {', '.join(sorted(known))})")
    for policy in policies:
        options_for(policy, options)


def run_one(args: argparse.Namespace, system: str, rate: float, show_progress: bool,
            stop_below: float | None = None) -> dict[str, Any]:
    """One simulation (picklable: runs in a worker process). ``stop_below``: a target
    attainment (over every request) whose verdict is all the caller needs: the run stops
    once it is certain to miss it, and its metrics are then only ``slo_attainment`` (the
    highest still possible, under the target) and why it stopped (``stopped_early``)."""
    from tqdm import tqdm

    trace = build_trace(args, rate)
    tbt_slo = getattr(args, "tbt_slo", None)
    watch = None
    if stop_below is not None:
        trace = list(trace)
        watch = VerdictWatch.for_requests(("all",), [r.arrival_s for r in trace], ["all"] * len(trace),
                                          slo_s=args.slo, target=stop_below, when=StopWhen.ANY_REGION_FAILS,
                                          warmup_s=args.warmup_s, tbt_slo_s=tbt_slo)
    total = len(trace) if isinstance(trace, list) else args.requests
    sim = Simulator(sim_config(args, system))
    t0 = time.perf_counter()
    c0 = time.process_time()
    with tqdm(total=total, desc=f"{system} x{rate:g}", unit="req", leave=False, mininterval=2.0,
              disable=not show_progress) as bar:
        res = sim.run(trace, progress=bar.update, watch=watch)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    if res.stopped_early:
        assert watch is not None
        return {"system": system, "rate": rate, "ttfts": [], "load": [], "load_replicas": [],
                "metrics": {"slo_attainment": watch.upper(0), "stopped_early": res.stopped_early,
                            "requests": total, "simulated": int(res.arrival.size), "rate_multiplier": rate,
                            "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "events": res.events}}
    m = res.summary(args.slo, args.warmup_s, tbt_slo)
    span = float(res.arrival.max() - res.arrival.min()) if res.arrival.size > 1 else 1.0
    m["rate"] = round(res.arrival.size / max(1e-9, span), 4)
    m["rate_multiplier"] = rate
    m["wall_s"] = round(wall, 2)
    m["cpu_s"] = round(cpu, 2)
    m["events"] = res.events
    # the policy's predicted cached prefix (Decision.matched_tokens) vs the engine's at
    # admission: share within one engine block, and share over-predicted by more
    acc = res.prediction_accuracy(args.block_size, args.warmup_s)
    m["prediction_within_block"] = None if acc is None else round(acc, 4)
    m["prediction_over"] = res.prediction_over(args.block_size, args.warmup_s)
    m["simulated_s"] = round(res.sim_time_s, 1)
    m["max_replica_waiting"] = res.max_replica_waiting
    m["max_replica_unadmitted"] = res.max_replica_unadmitted
    if res.slo_class_names:
        m["classes"] = res.class_summaries(args.warmup_s)
    if len(res.region_names) > 1:
        m["regions"] = res.region_summaries(args.slo, args.warmup_s, tbt_slo)
    ttfts = res.ttft[~(res.ttft != res.ttft)]
    if ttfts.size > 50_000:
        ttfts = ttfts[:: ttfts.size // 50_000 + 1]
    return {"system": system, "rate": rate, "metrics": m, "ttfts": ttfts.tolist(),
            "load": res.load_series, "load_replicas": res.plotted_replicas}
