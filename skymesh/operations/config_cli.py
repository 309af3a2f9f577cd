"""`skymesh config --config FILE`: validate a config and print a summary.

``--schema`` prints the JSON schema of the config format instead (for editors and CI
linting); with ``--config`` the file is validated first.
"""

from __future__ import annotations

import argparse
import json

from skymesh.config import config_schema, load_config_for_command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file (default: the embedded local mesh)")
    p.add_argument("--schema", action="store_true", help="print the JSON schema of the config format")


def run(args: argparse.Namespace) -> int:
    cfg = load_config_for_command(args.config)
    if cfg is None:
        return 2
    if args.schema:
        # stdout stays pure JSON so it can be piped into a file or a linter
        print(json.dumps(config_schema(), indent=2))
        return 0
    print(f"ok: model={cfg.model} policy={cfg.policy.name} dns={cfg.dns.name} ({cfg.dns.provider})")
    for r in cfg.regions:
        print(f"  {r.name}: balancer {r.balancer.listen}, {len(r.replicas)} replicas")
    return 0
