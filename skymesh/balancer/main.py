"""`skymesh balancer --config FILE --region NAME`: run one regional balancer."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from skymesh.config import ConfigError, load_config
from skymesh.gc_tuning import tune_gc
from skymesh.logging_setup import setup_logging
from skymesh.procs import serve_until_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="mesh YAML (default: the embedded local mesh)")
    p.add_argument("--region", required=True, help="which region of the config this balancer serves")
    p.add_argument("--policy", default=None, help="override the config's routing policy")
    p.add_argument("--balancer-id", default=None)
    p.add_argument("--no-controller", action="store_true", help="run from the YAML alone")
    p.add_argument("--no-peers", action="store_true", help="region-local: no heartbeats, no offload")
    p.add_argument("--log-level", default="INFO")


async def serve(args: argparse.Namespace) -> int:
    from skymesh.balancer.server import Balancer
    from skymesh.balancer.services import attach_services

    cfg = load_config(args.config)
    balancer = Balancer(cfg, args.region, balancer_id=args.balancer_id, policy_name=args.policy)
    attach_services(balancer, peers=not args.no_peers, controller=not args.no_controller)

    async def start() -> None:
        await balancer.start()
        tune_gc()

    return await serve_until_signal(start, balancer.stop)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        cfg = load_config(args.config)
        cfg.region(args.region)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except KeyError:
        print(f"config error: no region named {args.region!r}", file=sys.stderr)
        return 2
    logging.getLogger("skymesh").debug("starting balancer for %s", args.region)
    return asyncio.run(serve(args))
