"""`skymesh bench MODE ...`: the benchmark entry point.

Modes: `routing` (decision-time micro-benchmark), `proxy` (balancer CPU per proxied
request vs a direct hit and vs sglang-router), `trace` (live trace replay through
real routers and stand-in replicas; the default, so `skymesh bench --trace FILE ...`
works) and `agree` (the live and the discrete-event modes on the same trace slice,
compared system by system).
"""

from __future__ import annotations

import argparse
import importlib

# mode -> (module with add_arguments(parser) and run(args) -> int, one-line help)
MODES: dict[str, tuple[str, str]] = {
    "trace": ("skymesh.bench.live",
              "live trace replay through real routers and stand-in replicas (the default mode: "
              "`skymesh bench --trace FILE ...`)"),
    "routing": ("skymesh.bench.routing_micro", "routing decision time per policy at 8/32/128 replicas"),
    "proxy": ("skymesh.bench.proxy_cost",
              "balancer CPU per proxied request vs a direct hit and vs sglang-router"),
    "agree": ("skymesh.bench.agreement",
              "live vs discrete-event agreement on one trace slice, system by system"),
}
DEFAULT_MODE = "trace"


def with_default_mode(argv: list[str]) -> list[str]:
    """``argv`` after `skymesh bench` with the default mode inserted when it names none
    (`skymesh bench --trace FILE ...` is the live replay); `--help` alone lists the modes."""
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        return [DEFAULT_MODE, *argv]
    return argv


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Benchmarks. A MODE comes first; without one, the options are the live "
                     f"trace replay's (`skymesh bench --trace FILE ...` is `skymesh bench {DEFAULT_MODE} ...`). "
                     "`skymesh bench MODE --help` lists a mode's options.")
    sub = p.add_subparsers(dest="mode", metavar="MODE")
    sub.required = True
    for mode, (module, help_text) in MODES.items():
        sp = sub.add_parser(mode, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(sp)
        sp.set_defaults(_mode_run=mod.run)


def run(args: argparse.Namespace) -> int:
    return int(args._mode_run(args) or 0)
