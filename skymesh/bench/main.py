"""`skymesh bench MODE ...`: the benchmark entry point.

Modes: `routing` (decision-time micro-benchmark) and `proxy` (balancer CPU per proxied
request vs a direct hit and vs sglang-router).
"""

from __future__ import annotations

import argparse
import importlib

MODES = {
    "routing": "skymesh.routing.bench",
    "proxy": "skymesh.bench.proxy_cost",


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
