"""SLO classes on the benchmarks' command lines (``skymesh sim`` and ``skymesh bench``):
``--slo-classes FILE`` (a YAML file with a ``slo_classes:`` mapping, a mesh config will do,
validated as the mesh config validates it) and ``--slo-mix NAME=SHARE,...`` (each session
draws a class with these shares, seeded by ``--seed``; trace rows naming their own class
keep it)."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from skymesh.bench.traces import TraceRequest, assign_slo_classes
from skymesh.config import SloClassConfig, SloClassName
from skymesh.routing.disciplines.base import DEFAULT_MAX_AGE_S
from skymesh.routing.disciplines.prefix_match import DEFAULT_PREFIX_TTFT_SHARE
from skymesh.routing.queue_registry import DISCIPLINES
from skymesh.validation import first_error


def add_class_arguments(p: argparse.ArgumentParser, store: type[argparse.Action] | str = "store") -> None:
    """The class options both modes take (``skymesh sim`` and ``skymesh bench``); ``store``:
    the action of the queue options (``skymesh sim`` notes which were given, as a
    ``--config`` file supplies their defaults)."""
    p.add_argument("--slo-classes", default=None, metavar="YAML",
                   help="a YAML file with a slo_classes: mapping (a mesh config will do): the classes' targets "
                        "(live: scaled by --time-scale)")
    p.add_argument("--slo-mix", default=None, metavar="NAME=SHARE,...",
                   help="give each session a class drawn with these shares (seeded by --seed); rows naming "
                        "their own slo_class keep it; live requests send it as X-SLO-Class")
    p.add_argument("--no-early-rejection", action="store_true",
                   help="the balancer queues requests whose class's TTFT cannot be met instead of rejecting them")
    p.add_argument("--queue-discipline", choices=tuple(DISCIPLINES), default="fcfs", action=store,
                   help="the balancer's order within a priority: arrival, each head annealed for SLO attainment, "
                        "or a freed replica's best-matching request first (FEATHER)")
    p.add_argument("--queue-max-age-s", type=float, default=DEFAULT_MAX_AGE_S, action=store,
                   help="the slo and prefix disciplines' starvation bound (queue.max_age_s): a request queued "
                        "this long goes first")
    p.add_argument("--prefix-ttft-share", type=float, default=DEFAULT_PREFIX_TTFT_SHARE, action=store,
                   help="the prefix discipline's tail bound (queue.prefix_ttft_share): a request that waited this "
                        "share of its TTFT target goes first")


def slo_classes(args: argparse.Namespace) -> dict[str, SloClassConfig]:
    """The classes of ``--slo-classes`` (validated as the mesh config validates them)."""
    if not args.slo_classes:
        return {}
    try:
        data = yaml.safe_load(Path(args.slo_classes).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SystemExit(f"--slo-classes {args.slo_classes}: {e}") from None
    raw = data.get("slo_classes") if isinstance(data, dict) else None
    if not isinstance(raw, dict) or not raw:
        raise SystemExit(f"--slo-classes {args.slo_classes}: no slo_classes: mapping in it")
    try:
        return TypeAdapter(dict[SloClassName, SloClassConfig]).validate_python(raw)
    except ValidationError as e:
        path, message = first_error(e)
        raise SystemExit(f"--slo-classes {args.slo_classes}: slo_classes.{path}: {message}") from None


def slo_mix(args: argparse.Namespace) -> dict[str, float]:
    if not args.slo_mix:
        return {}
    known = slo_classes(args)
    out: dict[str, float] = {}
    for item in args.slo_mix.split(","):
        name, sep, share = item.partition("=")
        try:
            value = float(share)
        except ValueError:
            value = -1.0
        if not sep or name not in known or not value >= 0:
            raise SystemExit(f"--slo-mix {item!r}: expected NAME=SHARE with NAME one of --slo-classes "
                             f"({', '.join(known) or 'none given'})")
        out[name] = value
    return out


def with_slo_mix(reqs: list[TraceRequest], args: argparse.Namespace) -> list[TraceRequest]:
    """``reqs`` with ``--slo-mix`` applied (unchanged without one)."""
    mix = slo_mix(args)
    if not mix:
        return reqs
    drawn = assign_slo_classes(reqs, mix, args.seed)
    return [r if r.slo_class else d for r, d in zip(reqs, drawn, strict=True)]
