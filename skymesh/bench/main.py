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

MODES = {
    "routing": "skymesh.bench.routing_micro",
    "proxy": "skymesh.bench.proxy_cost",
    "trace": "skymesh.bench.live",
    "agree": "skymesh.bench.agreement",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="mode", metavar="MODE")
    sub.required = True
    for mode, module in MODES.items():
        sp = sub.add_parser(mode)
        mod = importlib.import_module(module)
        mod.add_arguments(sp)
        sp.set_defaults(_mode_run=mod.run)


def run(args: argparse.Namespace) -> int:
    return int(args._mode_run(args) or 0)
