"""`skymesh config --config FILE`: validate a config and print a summary."""

from __future__ import annotations

import argparse
import sys

from skymesh.config import ConfigError, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file (default: the embedded local mesh)")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(f"ok: model={cfg.model} policy={cfg.policy.name} dns={cfg.dns.name} ({cfg.dns.provider})")
    for r in cfg.regions:
        print(f"  {r.name}: balancer {r.balancer.listen}, {len(r.replicas)} replicas")
    return 0
